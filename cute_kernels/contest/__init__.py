"""Contest-style problems (GPU MODE format): a local harness with the public protocol.

``python -m cute_kernels.contest test|benchmark|leaderboard PROBLEM_DIR`` runs a problem folder
the way the public leaderboards do (``harness.py``); the evaluation script that runs inside the
problem's folder is ``eval_script.py`` (standard library and torch only, so it also runs a
submission bundled without this package); ``python -m cute_kernels.contest bundle`` writes that
standalone file (``bundle.py``).
"""
