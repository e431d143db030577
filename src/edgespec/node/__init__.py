"""The node side of the ring: what runs on each device (docs/design.md 7).

``daemon.py`` the `edgespec node` process and its control plane, ``datapath.py`` its data path
(one ``HostedStage`` per hosted window), ``worker.py`` running batches through windows, ``runtime.py``
one window on llama.cpp, ``profiling.py`` per-layer timing, ``info.py`` what a node says about
itself. Nothing here imports ``edgespec.head``.
"""
