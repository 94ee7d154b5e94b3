"""Requests for vLLM's engine, made without its input processing on every row.

vLLM's `LLMEngine.add_request` turns each prompt into an `EngineCoreRequest`: it validates the
pooling parameters (the same for every row of a run), checks the prompt's length and token ids,
deep-copies the parameters, and builds the request: a large share of the front end's cost a row on
short rows, and the front ends' cores are what bound a GPU's engines. `Requests` has
vLLM make the first request of an engine, keeps it as a template, and makes each later one as a
copy carrying the row's ids, after the same length and vocabulary checks vLLM makes; add_request
takes a request made already (its `EngineCoreRequest` branch) and does the rest as for any other.

The copies are used only where they equal what vLLM makes, checked on this vLLM at the first
submission; otherwise, and for any row outside the checks, vLLM processes the prompt as before
(and refuses it with its own message).
"""

from __future__ import annotations

import inspect
import logging

log = logging.getLogger(__name__)

# what vLLM logs, once per process, when handed a request made already
_HANDED_MADE = "Passing EngineCoreRequest"


class _DropHandedMade(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_HANDED_MADE)


def _prompt_maker():
    """Token ids as vLLM's engine takes them. Recent vLLM takes an already rendered input
    (`tokens_input`), which skips its renderer on every request: the engine thread's
    per-request cost is what bounds one engine on short rows. Older vLLM takes a TokensPrompt."""
    try:
        from vllm.inputs import tokens_input
    except ImportError:
        from vllm.inputs import TokensPrompt

        return lambda ids: TokensPrompt(prompt_token_ids=ids)
    return tokens_input


class Requests:
    """Adds rows of token ids to one vLLM engine (`llm_engine`: vLLM's LLMEngine)."""

    def __init__(self, llm_engine, params):
        import msgspec  # vLLM's requests are msgspec structs

        self.engine, self.prompt, self.params = llm_engine, _prompt_maker(), params
        self._replace = msgspec.structs.replace
        self.template = None  # the request vLLM made for the first row, once copies are known to be right
        self.checked = False
        cfg = llm_engine.model_config
        self.max_len, self.vocab = int(cfg.max_model_len), int(cfg.get_vocab_size())

    def add(self, rid: str, ids: list[int], now: float) -> None:
        """Queue one row (`rid`: its request id, `now`: its arrival time); vLLM's errors pass through."""
        fits = bool(ids) and len(ids) <= self.max_len and min(ids) >= 0 and max(ids) < self.vocab
        if fits and not self.checked:
            self.checked = True
            self.template = self._check(ids)
        if fits and self.template is not None:
            self.engine.add_request(rid, self._copy(self.template, rid, ids, now), self.params)
        else:
            self.engine.add_request(rid, self.prompt(ids), self.params)

    def _copy(self, t, rid: str, ids: list[int], now: float):
        # the parameters copied per request as vLLM does (shallow: ours hold no containers that change)
        return self._replace(t, request_id=rid, prompt_token_ids=ids, arrival_time=now,
                             pooling_params=self._replace(t.pooling_params))

    def _check(self, ids: list[int]):
        """vLLM's request for `ids` as a template, where a copy of it for other ids equals the request
        vLLM makes for them; else None (every row goes through vLLM's processing)."""
        try:
            if "isinstance(prompt, EngineCoreRequest)" not in inspect.getsource(type(self.engine).add_request):
                log.debug("vLLM's add_request takes no request made already: each row is processed by vLLM")
                return None
            processor, tasks = self.engine.input_processor, self.engine.get_supported_tasks()
            made = processor.process_inputs("0", self.prompt(ids), self.params, supported_tasks=tasks)
            other = ids[::-1]
            want = processor.process_inputs("1", self.prompt(other), self.params, supported_tasks=tasks)
            if made.pooling_params is None or self._copy(made, "1", other, want.arrival_time) != want:
                log.debug("a request copied from vLLM's differs from the one it makes: each row is processed by vLLM")
                return None
        except Exception as e:  # noqa: BLE001 - any surprise in vLLM's internals: its own path, as before
            log.debug("requests are made by vLLM (%s: %s)", type(e).__name__, e)
            return None
        logging.getLogger(type(self.engine).__module__).addFilter(_DropHandedMade())
        return made
