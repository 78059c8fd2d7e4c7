"""Stage `evaluate_base`: the evaluate stage applied once to the base model (see stages/evaluate.py)."""

from stages.evaluate import merge, run
from stages.harness import exit_with

if __name__ == "__main__":
    exit_with("evaluate_base", run, merge)
