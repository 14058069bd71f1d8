"""How a draft model is made cheaper, and the command-line flags that set it (torch-free).

`specdec generate`, `specdec bench generate` and `python -m draft_worker` share these flags; a flag
left unset keeps the :class:`DraftOptions` default.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields, replace


@dataclass
class DraftOptions:
    """How to make a draft model cheaper; none of it can change the output (the target verifies)."""

    quant: str | None = "int8"  # weight-only int8 on CPU
    vocab: int | None = 32768  # lm_head over the first N ids (BPE ids are ranked by merge order,
    #                            i.e. by frequency), every special token and every later id that is
    #                            only whitespace and punctuation (build.py); None = full vocabulary
    lookup: bool = True  # the draft model also checks prompt-lookup guesses (ModelDrafter's lookup)
    tree_width: int = 1  # children per grown node of a token tree; 1 drafts a chain (core/tree_drafting.py)
    tree_nodes: int = 16  # nodes of a token tree the target verifies at most
    tree_expand: int = 4  # nodes of a token tree grown per draft forward (its rows); 0: the chain's runners-up


def _width(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return int(text)


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return int(text)


def add_draft_option_flags(parser: argparse.ArgumentParser) -> None:
    defaults = DraftOptions()
    parser.add_argument(
        "--draft-quant",
        choices=["int8", "none"],
        default=None,
        help=f"weight-only int8 for the draft model (CPU; default {defaults.quant}); the target is never changed",
    )
    parser.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        metavar="N",
        help=f"draft lm_head over the N most frequent ids + special tokens + markup, 0 = full vocabulary "
        f"(default {defaults.vocab})",
    )
    parser.add_argument(
        "--draft-lookup",
        choices=["on", "off"],
        default=None,
        help="the draft model also checks prompt-lookup guesses, drafting copied text in one forward (default on)",
    )
    parser.add_argument(
        "--draft-tree-width",
        type=_width,
        default=None,
        metavar="N",
        help=f"draft a token tree, each grown node adding N next tokens (the draft model's best; for sampling "
        f"requests, N drawn from it), verified in one forward; 1 drafts a chain (default {defaults.tree_width})",
    )
    parser.add_argument(
        "--draft-tree-nodes",
        type=_width,
        default=None,
        metavar="N",
        help=f"nodes of a token tree the target verifies at most, the likeliest kept (default {defaults.tree_nodes})",
    )
    parser.add_argument(
        "--draft-tree-expand",
        type=_count,
        default=None,
        metavar="N",
        help=f"nodes of a token tree grown per draft forward, the likeliest; 0 grows none: the chain's runners-up "
        f"are its leaves (default {defaults.tree_expand})",
    )


def draft_option_overrides(args: argparse.Namespace) -> dict:
    """The DraftOptions fields the flags set (a dict, so it can travel in a worker config)."""
    out: dict = {}
    if getattr(args, "draft_quant", None) is not None:
        out["quant"] = None if args.draft_quant == "none" else args.draft_quant
    if getattr(args, "draft_vocab", None) is not None:
        out["vocab"] = args.draft_vocab or None
    if getattr(args, "draft_lookup", None) is not None:
        out["lookup"] = args.draft_lookup == "on"
    if getattr(args, "draft_tree_width", None) is not None:
        out["tree_width"] = args.draft_tree_width
    if getattr(args, "draft_tree_nodes", None) is not None:
        out["tree_nodes"] = args.draft_tree_nodes
    if getattr(args, "draft_tree_expand", None) is not None:
        out["tree_expand"] = args.draft_tree_expand
    return out


def draft_options_from_args(args: argparse.Namespace) -> DraftOptions:
    return replace(DraftOptions(), **draft_option_overrides(args))


def draft_options_from_dict(d: dict | None) -> DraftOptions:
    """DraftOptions from a config dict, refusing unknown keys."""
    known = {f.name for f in fields(DraftOptions)}
    unknown = sorted(set(d or {}) - known)
    if unknown:
        raise ValueError(f"draft_options: unknown keys {unknown} (known: {sorted(known)})")
    options = DraftOptions(**(d or {}))
    for name, least in (("tree_width", 1), ("tree_nodes", 1), ("tree_expand", 0)):
        value = getattr(options, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"draft_options.{name}: must be an integer >= {least} (got {value!r})")
    return options
