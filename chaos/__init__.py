"""The chaos run: workers, a nemesis and a history checker (``make chaos``).

See docs/development.md.
"""
