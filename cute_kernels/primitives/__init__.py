"""Device-side building blocks shared by kernel families."""
