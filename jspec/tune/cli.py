"""``jspec tune``: the machine's cost profile (the parser and the command; :mod:`jspec.cli` is the entry point)."""

from __future__ import annotations

import json

__all__ = ["add_tune_commands"]


def add_tune_commands(sub, positive_int, add_json) -> None:
    """Registers ``jspec tune profile`` on the command line's subparsers."""
    p = sub.add_parser("tune", help="measure this machine's costs (profile) to choose a method from numbers")
    tune = p.add_subparsers(dest="tune_command", required=True, metavar="WHAT")
    p = tune.add_parser("profile", help="the target's k-token forward cost and each drafter's step cost, cached")
    p.add_argument("--model", default="smollm2-135m", help="registry name or a Hugging Face model folder")
    p.add_argument("--batch", type=positive_int, default=1, help="rows per batch (measured at its power-of-two bucket)")
    p.add_argument("--num-draft", default="1,2,3,4,5,6,7", help="chain lengths N to measure each drafter at")
    p.add_argument("--trees", default="dynamic", help="trees to measure, separated by ';' (dynamic, 2,2,2, ...)")
    p.add_argument("--head", default=None, help="an EAGLE-3 head's folder (default: the one shipped for --model)")
    p.add_argument("--draft-model", default=None, help="a draft model to measure too (registry name or folder)")
    p.add_argument("--max-k", type=positive_int, default=8, help="measure target forwards of 1..K tokens at least")
    p.add_argument("--force", action="store_true", help="measure again even when a cached profile covers the request")
    add_json(p)
    p.set_defaults(fn=_cmd_tune_profile)


def _cmd_tune_profile(args) -> int:
    from jspec.models.hub import load_model
    from jspec.tune.costs import (
        load_profile,
        measure_profile,
        profile_drafters,
        profile_path,
        save_profile,
        verify_widths,
        weights_dtype,
    )

    num_drafts = _int_list(args.num_draft, "--num-draft")
    trees = [t for t in args.trees.split(";") if t.strip()] if args.trees else []
    model, _ = load_model(args.model)
    dtype = weights_dtype(model)
    path = profile_path(args.model, args.batch, dtype=dtype)
    cached = None if args.force else load_profile(path)  # a damaged file is refused here, and kept
    draft_model = load_model(args.draft_model)[0] if args.draft_model else None
    drafters = profile_drafters(model, args.model, num_drafts=num_drafts, trees=trees, head=args.head,
                                draft_model=draft_model)  # fmt: skip
    max_k = max(verify_widths(drafters), args.max_k)
    covers = cached is not None and set(drafters) <= set(cached.drafters) and max(cached.forward_ms) >= max_k
    profile = cached if covers else measure_profile(model, args.model, drafters, batch=args.batch, max_k=max_k)
    if not covers:
        save_profile(profile, path)
    if args.json:
        print(json.dumps({"path": str(path), "cached": covers, "profile": profile.to_json()}))
        return 0
    how = "cached" if covers else f"measured in {profile.seconds:.0f} s"
    print(f"{args.model} on {profile.backend} ({profile.device_kind}, {profile.dtype}, batch bucket {profile.batch}): "
          f"{how}; {path}")  # fmt: skip
    print(f"one target step {profile.step_ms:.1f} ms; r(k), a k-token forward over one step:")
    print("  " + "  ".join(f"k={k}: {profile.relative_forward(k):.2f}" for k in sorted(profile.forward_ms)))
    print("drafter cost per step (propose + commit), in target steps:")
    for name in sorted(profile.drafters):
        print(f"  {name:<24} {profile.relative_drafter(name):.3f}")
    return 0


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes whole numbers separated by commas, e.g. 1,2,3; got {text!r}.") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} takes whole numbers >= 1; got {text!r}.")
    return values
