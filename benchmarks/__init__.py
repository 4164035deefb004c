"""tsckpt's benchmarks: ``python -m benchmarks SCENARIO [options]`` from the repository's root.

``python -m benchmarks --list`` names the scenarios (``scenarios.py``); each runs
one script of this folder, which can also be run on its own. The scripts
import each other by their file names, with this folder on ``sys.path``.
"""
