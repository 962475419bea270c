#!/usr/bin/env python
"""The realistic project's manage.py (docs/development.md, "The realistic project")."""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "realproject.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
