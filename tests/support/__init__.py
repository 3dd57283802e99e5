"""Test-only helpers shared by the unit, dataplane, healthz, lab and bench tests.

Imported by package name (``from tests.support.objects import service``).
"""
