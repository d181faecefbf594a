"""Build the engine's Speculator from its Config (or none: the plain pipelined path)."""

from __future__ import annotations

from typing import Any

from tqserve.engine.speculative.policy import SpecChoice, SpecPolicy
from tqserve.engine.speculative.proposers import (DraftProposer, LookupProposer, LookupSettings,
                                                  Proposer)
from tqserve.engine.speculative.speculator import Speculator


def build_speculator(config: Any, loaded: Any, draft: Any = None) -> Speculator | None:
    """The proposers this server offers: lookup always, draft with `draft` (a LoadedModel of
    the draft model, --speculative-config's "model", same vocabulary), mtp where the target
    has an MTP head; draft and mtp with their state identity (engine.speculative.state).
    None when neither a method nor a draft model is set. ValueError naming the flag
    otherwise."""
    if config.speculative is None and config.draft_model is None:
        return None
    refused = _caches_without_rollback(loaded.model)
    if refused:
        flag = (f"--speculative {config.speculative}" if config.speculative is not None
                else "--speculative-config model")
        raise ValueError(f"{flag}: this model's {', '.join(refused)} layers cannot roll back "
                         "rejected positions row by row; serve it without speculation")
    proposers: dict[str, Proposer] = {
        "lookup": LookupProposer(LookupSettings(max_ngram=config.speculative_ngram))}
    if draft is not None:
        if draft.vocab_size != loaded.vocab_size:
            raise ValueError(f"the draft model (--speculative-config model) has a vocabulary of {draft.vocab_size} tokens, the "
                             f"model {loaded.vocab_size}: they must share the tokenizer")
        proposers["draft"] = DraftProposer(draft.model, identity=f"draft:{draft.fingerprint}")
    if config.speculative == "mtp":
        from tqserve.engine.speculative.mtp import MtpProposer, head_fingerprint, load_mtp_head
        proposers["mtp"] = MtpProposer(
            loaded.model, load_mtp_head(loaded.path, loaded.model),
            identity=f"mtp:{head_fingerprint(loaded.path, loaded.dtype)}")
    default = None
    if config.speculative is not None:
        default = SpecChoice(method=config.speculative,
                             num_tokens=config.num_speculative_tokens)
    return Speculator(proposers, default)


def _caches_without_rollback(model: Any) -> list[str]:
    """Class names of the model's layer caches that speculation cannot trim per row
    (sliding windows, recurrent state)."""
    from mlx_lm.models.cache import make_prompt_cache

    from tqserve.engine.snapshot import layer_kind
    return sorted({type(c).__name__ for c in make_prompt_cache(model)
                   if layer_kind(c) in (None, "state")})


def spec_policy(config: Any) -> SpecPolicy:
    """The speculation actor's policy settings from the Config's flags."""
    return SpecPolicy(max_batch=config.speculative_max_batch,
                      time_policy=config.speculative_time_policy)
