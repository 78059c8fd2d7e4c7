"""Stage `evaluate_base`: the evaluate stage applied once to the base model (see stages/evaluate.py)."""

from stages.common import exit_with
from stages.evaluate import run

if __name__ == "__main__":
    exit_with("evaluate_base", run)
