"""The head's side of edgespec (docs/design.md 1, 5): everything the process a user talks to
runs, apart from what runs on nodes.

- ``chain``: the engine's view of a ring (``Chain``) and ``LocalChain`` (stages in this process)
- ``remote``: the member RPC (``Member``, ``dial``) and ``RemoteChain``
- ``formation``: forming, linking, re-forming, re-attaching and unloading a ring
- ``planner``: layer windows per node
- ``state``: the ring state file, typed (``RingState``)
- ``view``: the one typed view of a ring (``ring status``, ``Ring.describe``, ``/v1/ring``)
- ``addresses``: ``host:port`` lists and mDNS discovery
- ``local``: node processes on this machine
- ``build``: the ``Ring`` constructors (up, attach, local) and ``ring up``; ``config``:
  ``HeadConfig``, what they take
- ``request``: one request from ``Ring.prepare`` to its ``Generation`` (``Request``)
- ``loop``: the ring's loop, the one thread that runs every request on the chain, its
  rebuild after a lost node and its replays (``RingLoop``)
- ``scheduler``: the one admission queue, slot choice, each step's sharers, the ring's rebuild
- ``slots``: a slot's seq ids, its view of the shared chain and who owns each lap
  (``SlotChain``, ``Demux``)
- ``output``: tokens to text, and where an answer ends (``OutputProcessor``)
- ``tools``: tool calls: OpenAI tools and messages into the chat template, the model's calls
  parsed back (whole and streamed), the grammar of a forced call
- ``engine/``: the speculative engine, its modes and the policy that sizes trees

Nothing is imported here, so importing a submodule loads only what it needs.
"""
