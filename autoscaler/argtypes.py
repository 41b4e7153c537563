"""argparse value types shared by the autoscaler's commands (`kvgate autoscaler`, `kvgate sim`) and
`kvgate up`, so that a bad number reads the same one line everywhere."""

from __future__ import annotations

import argparse


def positive_float(text: str) -> float:
    """`type=` for an option that must be a number > 0 (seconds, rates, scales); argparse turns the
    ArgumentTypeError into one usage line naming the option."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:  # `not >` also refuses nan
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """`type=` for a number that may be 0 (seconds of a grace, a delay)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:  # `not >=` also refuses nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value
