"""Command-line faces: build (also build_scripts/build_engine.py), run, bench, verify."""
