"""The emulated IPU's numerical core as a graph compiler; imports numpy only.

Pipeline position: ``model.ModelSpec`` describes the ops (``op.Op``, ``ops/``) and wires them into a
:class:`~ringtrain_trainer.engine.graph.Graph`; ``plan`` lays the parameters out in reverse
backward order and cuts the streaming piece grid; ``program.Program`` runs the graph with every
buffer planned once and announces each finished parameter range from its own backward
schedule. See docs/architecture.md.
"""
