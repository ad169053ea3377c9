"""Reading ``task.yml`` and case files (no YAML library needed).

``task.yml`` files of the public problems use a small part of YAML: top-level keys with
scalars, ``|`` block strings, one level of nested mappings, and lists of flow mappings
(``- {"size": 127, "seed": 4242}``) or block mappings. :func:`read_task` reads that part and
raises :class:`TaskFileError` (naming the line) on anything else.

Case files hold one case per line, ``key: value; key: value`` (the protocol's format).
"""

from __future__ import annotations

import re
from pathlib import Path


class TaskFileError(ValueError):
    """A task.yml or case line this reader does not understand."""


def scalar(text: str):
    """A YAML / case-file scalar: int, float, bool, null, or a (possibly quoted) string."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("null", "~", ""):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _split_top(text: str, sep: str) -> list[str]:
    """Split on ``sep`` outside quotes and brackets."""
    parts, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def flow(text: str, where: str):
    """A flow mapping ``{k: v, ...}``, flow list ``[a, b]`` or a scalar."""
    text = text.strip()
    if text.startswith("{"):
        if not text.endswith("}"):
            raise TaskFileError(f"{where}: unterminated mapping {text!r}")
        out = {}
        for item in _split_top(text[1:-1], ","):
            if not item.strip():
                continue
            key, sep, value = item.partition(":")
            if not sep:
                raise TaskFileError(f"{where}: expected key: value in {item!r}")
            out[scalar(key)] = flow(value, where)
        return out
    if text.startswith("["):
        if not text.endswith("]"):
            raise TaskFileError(f"{where}: unterminated list {text!r}")
        return [flow(item, where) for item in _split_top(text[1:-1], ",") if item.strip()]
    return scalar(text)


def _strip_comment(line: str) -> str:
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i].rstrip()
    return line.rstrip()


def parse_task(text: str, name: str = "task.yml") -> dict:
    """The mapping in ``text`` (see the module docstring for the YAML subset)."""
    lines = text.splitlines()
    out: dict = {}
    i = 0

    def indent(s: str) -> int:
        return len(s) - len(s.lstrip(" "))

    def block(i: int, base: int):
        """Lines indented deeper than ``base`` from i: a list, a mapping or nothing."""
        items: list | dict | None = None
        while i < len(lines):
            raw = _strip_comment(lines[i])
            if not raw.strip():
                i += 1
                continue
            if indent(raw) <= base:
                break
            body = raw.strip()
            where = f"{name}:{i + 1}"
            if body.startswith("- ") or body == "-":
                if items is None:
                    items = []
                if not isinstance(items, list):
                    raise TaskFileError(f"{where}: a list item inside a mapping")
                item = body[1:].strip()
                if item and not item.startswith("{") and re.match(r"^[\w\"'-]+\s*:", item):
                    # A block mapping starting on the dash line: `- key: value` then deeper keys.
                    key, _, value = item.partition(":")
                    entry = {scalar(key): flow(value, where)}
                    sub, i = block(i + 1, indent(raw) + 1)
                    if isinstance(sub, dict):
                        entry.update(sub)
                    items.append(entry)
                    continue
                items.append(flow(item, where))
                i += 1
                continue
            key, sep, value = body.partition(":")
            if not sep:
                raise TaskFileError(f"{where}: expected 'key: value', got {body!r}")
            if items is None:
                items = {}
            if not isinstance(items, dict):
                raise TaskFileError(f"{where}: a mapping key inside a list")
            items[scalar(key)], i = value_at(i, raw, value, where)
        return items, i

    def value_at(i: int, raw: str, value: str, where: str):
        value = value.strip()
        if value in ("|", "|-", ">", ">-"):
            collected, j = [], i + 1
            while j < len(lines) and (not lines[j].strip() or indent(lines[j]) > indent(raw)):
                collected.append(lines[j])
                j += 1
            width = min((indent(s) for s in collected if s.strip()), default=0)
            body = "\n".join(s[width:] for s in collected).rstrip("\n")
            if value.startswith(">"):
                body = " ".join(body.split("\n"))
            return body + ("" if value.endswith("-") else "\n"), j
        if value:
            return flow(value, where), i + 1
        sub, j = block(i + 1, indent(raw))
        return sub, j

    while i < len(lines):
        raw = _strip_comment(lines[i])
        if not raw.strip():
            i += 1
            continue
        where = f"{name}:{i + 1}"
        if indent(raw):
            raise TaskFileError(f"{where}: unexpected indentation")
        key, sep, value = raw.partition(":")
        if not sep:
            raise TaskFileError(f"{where}: expected 'key: value', got {raw.strip()!r}")
        out[scalar(key)], i = value_at(i, raw, value, where)
    return out


def read_task(folder: Path) -> dict:
    """``folder/task.yml`` with the protocol's defaults filled in."""
    path = Path(folder) / "task.yml"
    task = parse_task(path.read_text(), str(path))
    for key in ("tests", "benchmarks"):
        cases = task.get(key) or []
        if not isinstance(cases, list) or not all(isinstance(c, dict) for c in cases):
            raise TaskFileError(f"{path}: '{key}' must be a list of mappings")
        task[key] = cases
    task.setdefault("ranking_by", "last")
    if task["ranking_by"] not in ("last", "geom", "mean"):
        raise TaskFileError(f"{path}: ranking_by={task['ranking_by']!r}; expected last, geom or mean")
    return task


def format_case(case: dict) -> str:
    """One case-file line: ``key: value; key: value``."""
    for key, value in case.items():
        text = f"{key}{value}"
        if any(ch in text for ch in ";:\n"):
            raise TaskFileError(f"case {case!r}: keys and values may not contain ';', ':' or newlines")
    return "; ".join(f"{k}: {v}" for k, v in case.items())


def parse_case(line: str, number: int = 0) -> dict:
    """A case-file line back into a mapping (values as int / float / bool / str)."""
    case = {}
    for part in line.strip().split(";"):
        if not part.strip():
            continue
        key, sep, value = part.partition(":")
        if not sep or not key.strip():
            raise TaskFileError(f"case line {number}: expected 'key: value', got {part.strip()!r}")
        case[key.strip()] = scalar(value)
    return case
