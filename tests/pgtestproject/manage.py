#!/usr/bin/env python
"""A small project on PostgreSQL for tests/test_database_pgproject.py (issue 27)."""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "pgtestproject.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
