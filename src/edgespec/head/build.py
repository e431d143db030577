"""Building a head: the ``Ring`` constructors (``up``, ``attach``, ``local``) and the one
place that turns a chain into a head (tokenizer, drafter, engine) and brings a ring up
(docs/design.md 5.3). ``edgespec ring up`` and ``Ring.up`` both go through ``ring_up``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from edgespec.drafters.factory import make_drafter, shared_draft_context
from edgespec.errors import NodeLost, RingError
from edgespec.head.addresses import discover, parse_nodes
from edgespec.head.config import HeadConfig
from edgespec.head.formation import form_ring, reform_ring, unload_nodes
from edgespec.head.remote import Address, RemoteChain, head_identity
from edgespec.head.state import load_state, save_state, state_path
from edgespec.llm import models

log = logging.getLogger("edgespec.ring")


def build_head(cls, chain: Any, model: Path, config: HeadConfig | None = None, *,
               n_ctx: int = 4096, on_close=None, recover=None, tok_model=None):
    """The head (a ``cls``, i.e. ``Ring``) over ``chain``: the model's tokenizer, the drafter
    and the engine, as ``config`` says. ``tok_model``: the vocab-only model when the caller
    loaded it already (it is closed with the head either way). Every slot drafts with a
    drafter of its own, on one context of the draft model that they share."""
    from edgespec.llm.llamacpp import load_model
    from edgespec.llm.tokenizer import Tokenizer

    config = config or HeadConfig()
    draft, drafter, draft_quant = config.draft, config.drafter, config.draft_quant
    parallel = config.parallel
    own = tok_model is None
    if tok_model is None:
        tok_model = load_model(model, vocab_only=True)
    shared = None
    try:
        # The slots draft on one context of the draft model: concurrent decodes share a
        # batch (edgespec.drafters.draft_context, docs/design.md 5.8).
        shared = shared_draft_context(draft, drafter, draft_quant, parallel, n_ctx)
        views = iter(range(parallel))

        def new_drafter():
            seqs = shared.view(next(views)) if shared is not None else None
            return make_drafter(model, draft, drafter, draft_quant, seqs=seqs)

        drafter_obj = new_drafter()
    except BaseException:
        if shared is not None:
            shared.close()
        if own:
            tok_model.close()
        raise

    def close() -> None:
        tok_model.close()
        if on_close is not None:
            on_close()

    made = [drafter_obj]

    def drafter_factory():
        # The first slot takes the drafter made above; each further slot a new one.
        return made.pop() if made else new_drafter()

    try:
        ring = cls(chain, Tokenizer(tok_model), model_name=Path(model).stem,
                   spec=config.spec, drafter_factory=drafter_factory, n_ctx=n_ctx,
                   on_close=close, engine=config.engine, recover=recover,
                   parallel=parallel, max_queue=config.max_queue)
    except BaseException:
        for d in made:
            with contextlib.suppress(Exception):
                d.close()
        if shared is not None:
            shared.close()
        if own:
            tok_model.close()
        raise
    ring.draft_name = Path(draft).name if draft is not None else None
    return ring


def recovering(model: Path, key_bytes: bytes, known: list[Address], head: dict,
               options: dict, **form: Any) -> Callable[[Exception], RemoteChain]:
    """The recovery of a saved ring: re-form over the known nodes that answer, and save the
    plan now in force (``ring status`` shows it; the lost nodes are listed as left)."""

    def recover(exc: Exception) -> RemoteChain:
        chain = reform_ring(known, model, key_bytes, head=head, profile=False, **form)
        with contextlib.suppress(OSError):
            save_state(chain, model, options, known=known, reason=f"lost: {exc}")
        return chain

    return recover


def rebalancing(model: Path, key_bytes: bytes, known: list[Address], head: dict,
                options: dict, **form: Any) -> Callable[[list[Address], bool], RemoteChain]:
    """The rebalance of a saved ring by the head that holds it (``Ring.rebalance``): re-form
    over the known nodes and ``extra`` that answer, profiled unless told otherwise, and save
    the new plan; ``extra`` nodes are known from then on."""

    def rebalance(extra: list[Address], profile: bool) -> RemoteChain:
        known.extend(a for a in extra if a not in known)
        chain = reform_ring(known, model, key_bytes, head=head, profile=profile, **form)
        with contextlib.suppress(OSError):
            save_state(chain, model, options, known=known,
                       reason="did not answer at rebalance")
        return chain

    return rebalance


def find_nodes(nodes: str, key_bytes: bytes, *, expect: int | None = None,
               timeout: float = 5.0, log_fn: Callable[[str], None] = log.warning
               ) -> list[Address]:
    """``nodes="auto"``: the nodes found over mDNS that prove the key; else the
    ``host:port,...`` list."""
    if nodes == "auto":
        return discover(expect, timeout, key_bytes, log_fn=log_fn)
    return parse_nodes(nodes)


def ring_up(model_path: Path, addrs: Sequence[Address], key_bytes: bytes, *,
            key_file: str | os.PathLike[str] | None = None, rounds: int = 1,
            ranges: Sequence[tuple[int, int]] | None = None, n_ctx: int = 4096,
            encoding: str = "f32", profile: bool = True, head: dict | None = None,
            take_over: bool = False, log_fn: Callable[[str], None] = log.info,
            warn: Callable[[str], None] = log.warning,
            proxy: Callable[[Address], Address] | None = None) -> tuple[RemoteChain, Path]:
    """Form the ring over ``addrs``, save its state, and have the nodes of the previous ring
    that are not in this one give their memory back. Returns the chain and the state path.
    ``proxy``: the address to dial for a node's address (a link emulator's, in benchmarks)."""
    head = head or head_identity()
    previous: list = []
    if state_path().exists():
        with contextlib.suppress(RingError):
            previous = load_state().named_nodes()
    chain = form_ring(addrs, model_path, key_bytes, ranges=ranges, rounds=rounds, n_ctx=n_ctx,
                      encoding=encoding, profile=profile, log_fn=log_fn, head=head,
                      take_over=take_over, proxy=proxy)
    try:
        path = save_state(chain, model_path, {"encoding": encoding, "n_ctx": n_ctx,
                                              "key_file": key_file})
        dropped = [(n, a) for n, a in previous if a not in addrs]
        if dropped:
            log_fn(f"unloading {len(dropped)} node(s) of the previous ring that are not in "
                   f"this one")
            unload_nodes(dropped, key_bytes, head=head, take_over=take_over, say=log_fn,
                         warn=warn)
    except BaseException:
        chain.close()
        raise
    return chain, path


def attach(cls, state: str | os.PathLike[str] | None = None,
           config: HeadConfig | None = None, *, key: str | None = None,
           take_over: bool = False):
    """A head for the ring saved by ``edgespec ring up``.

    A node that restarted or vanished since is handled like a loss: the ring is re-formed
    over the nodes that answer (and the state file updated)."""
    from edgespec.head.formation import attach_chain
    from edgespec.wire.auth import load_key

    st = load_state(state)
    key_bytes = load_key(key or st.key_file)
    head = head_identity()
    model = Path(st.model)
    known = st.node_addresses()  # one list: nodes a rebalance takes in, a recovery knows too
    # A re-formed ring keeps the sequences this head's slots were cut from.
    recover = recovering(model, key_bytes, known, head, st.options, n_ctx=st.n_ctx,
                         encoding=st.encoding, n_seq_max=st.n_seq_max, take_over=take_over)
    try:
        chain = attach_chain(st, key_bytes, head=head, take_over=take_over)
    except NodeLost as e:
        log.warning("the saved ring is not intact (%s); re-forming it", e)
        chain = recover(e)
    ring = build_head(cls, chain, model, config, n_ctx=st.n_ctx, recover=recover)
    ring._rebalance_fn = rebalancing(model, key_bytes, known, head, st.options,
                                     n_ctx=st.n_ctx, encoding=st.encoding,
                                     n_seq_max=chain.n_seq_max)
    return ring


def up(cls, model: str | os.PathLike[str], nodes: str = "auto",
       config: HeadConfig | None = None, *, key: str | None = None,
       expect: int | None = None, timeout: float = 5.0, rounds: int = 1,
       ranges: Sequence[tuple[int, int]] | None = None, n_ctx: int = 4096,
       encoding: str = "f32", take_over: bool = False,
       proxy: Callable[[Address], Address] | None = None):
    """Discover (or list) nodes, bring the ring up (``ring_up``), and return its head.
    ``proxy`` as for ``ring_up`` (kept by its recovery and rebalance)."""
    from edgespec.wire.auth import ensure_key

    config = config or HeadConfig()
    key_bytes = ensure_key(key)
    model_path = models.resolve(model)
    if config.draft is not None:  # refuse another family's draft before any node loads
        from edgespec.drafters.tokenizer import check_draft_tokenizer

        check_draft_tokenizer(models.resolve(config.draft), model_path)
    head = head_identity()
    addrs = find_nodes(nodes, key_bytes, expect=expect, timeout=timeout)
    chain, _path = ring_up(model_path, addrs, key_bytes, key_file=key, rounds=rounds,
                           ranges=ranges, n_ctx=n_ctx, encoding=encoding, head=head,
                           take_over=take_over, proxy=proxy)
    options = {"encoding": encoding, "n_ctx": n_ctx, "key_file": key}
    known = list(addrs)
    # A re-formed ring keeps the sequences this head's slots were cut from.
    form = {"n_ctx": n_ctx, "encoding": encoding, "rounds": rounds,
            "n_seq_max": chain.n_seq_max, "proxy": proxy}
    recover = recovering(model_path, key_bytes, known, head, options, **form)
    ring = build_head(cls, chain, model_path, config, n_ctx=n_ctx, recover=recover)
    ring._rebalance_fn = rebalancing(model_path, key_bytes, known, head, options, **form)
    return ring


def open_local_ring(cls, model: str | os.PathLike[str], stages: int,
                    config: HeadConfig | None = None, *, n_ctx: int = 4096,
                    processes: bool = True, verbose: bool = False, encoding: str = "f32",
                    threads: int = 1, proxy=None, ranges=None, rounds: int = 1):
    """Build a ``Ring`` (class ``cls``) over ``stages`` windows of ``model`` on this host."""
    from edgespec.llm.gguf_read import read_info
    from edgespec.llm.llamacpp import load_model, set_verbose
    from edgespec.llm.shards import even_ranges

    config = config or HeadConfig()
    set_verbose(verbose)
    model_path = models.resolve(model)
    if config.draft is not None and config.drafter != "retrieval":
        # A draft of another family is refused before any node process starts.
        from edgespec.drafters.tokenizer import check_draft_tokenizer

        check_draft_tokenizer(models.resolve(config.draft), model_path)
    info = read_info(model_path)
    tok_model = load_model(model_path, vocab_only=True)
    cleanup: list[Any] = []
    recover = None
    nodes = None
    try:
        if processes:
            from edgespec.head.local import LocalNodes
            from edgespec.wire.auth import load_key, write_key

            tmp = tempfile.TemporaryDirectory(prefix="edgespec-local-")
            cleanup.append(tmp.cleanup)
            key_file = write_key(Path(tmp.name) / "ring.key")
            key = load_key(key_file)
            nodes = LocalNodes(stages // rounds if rounds > 1 else stages, key_file,
                               threads=threads, verbose=verbose)
            cleanup.insert(0, nodes.close)
            # Every node has read the key by the time it listens: remove it from disk now, so
            # a head that is killed leaves no key folder behind.
            tmp.cleanup()
            rngs = ranges or even_ranges(info.n_layer, stages)
            quiet = print if verbose else (lambda s: None)
            head = head_identity()
            chain = form_ring(nodes.addresses, model_path, key, ranges=rngs,
                              rounds=rounds, n_ctx=n_ctx, encoding=encoding, profile=False,
                              proxy=proxy, log_fn=quiet, head=head)
            cleanup.insert(0, chain.close)

            def recover(_exc: Exception):
                # Node processes that died are gone for good; the survivors take their layers.
                live = [a for p, a in zip(nodes.procs, nodes.addresses, strict=True)
                        if p.poll() is None]
                return reform_ring(live, model_path, key, n_ctx=n_ctx, encoding=encoding,
                                   profile=False, proxy=proxy, log_fn=quiet, head=head,
                                   n_seq_max=chain.n_seq_max)
        else:
            from edgespec.head.chain import LocalChain, open_window
            from edgespec.llm.gguf_read import fingerprint

            fp = fingerprint(model_path)
            shard_dir = models.home() / "shards"
            runtimes = []
            for a, b in (ranges or even_ranges(info.n_layer, stages)):
                rt = open_window(model_path, (a, b), fp, shard_dir, n_ctx=n_ctx,
                                 n_threads=threads)
                runtimes.append(rt)
                cleanup.insert(0, rt.close)
            chain = LocalChain(runtimes, info.n_vocab)

        def on_close() -> None:
            for fn in cleanup:
                with contextlib.suppress(Exception):
                    fn()

        ring = build_head(cls, chain, model_path, config, n_ctx=n_ctx, on_close=on_close,
                          recover=recover, tok_model=tok_model)
    except BaseException:
        for fn in [*cleanup, tok_model.close]:
            with contextlib.suppress(Exception):
                fn()
        raise
    ring.local_nodes = nodes  # the node processes (None when all windows run in-process)
    return ring
