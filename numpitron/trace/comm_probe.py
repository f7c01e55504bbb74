"""Every collective and message of a topology's communicators, as spans: each `Comm` of
more than one rank gets instance-level wrappers around its methods (the class, and so
every untraced run, is untouched).

The bytes are the communication counters' own: the topology's `CommStats.add` is wrapped
too, and a call's span holds what the call added. A blocking call is one span on its
group's track (waited: all of it). A non-blocking one is a span on the group's "in
flight" track from its start until the rank sees it complete (in `wait`, or in a `test`
that finds it done), plus a "wait" span on the group's track for the part the rank
waited; the rest was hidden behind whatever ran meanwhile. A rank only learns that a
request completed when it asks, so "hidden" is what this rank could have hidden."""

from functools import partial

from numpitron.trace.recorder import Patches, now

BLOCKING = ("all_reduce", "reduce_scatter", "all_gather", "gather", "gatherv", "scatterv", "all_to_all",
            "all_to_allv", "broadcast", "send", "recv", "barrier", "broadcast_object", "gather_object",
            "all_reduce_object_max")
STARTING = ("iall_reduce", "ireduce_scatter", "iall_gather", "iall_to_allv", "isend", "irecv")
PEER = {"send": "dest", "isend": "dest", "recv": "source", "irecv": "source"}     # point-to-point: the peer's keyword
IN_FLIGHT = " in flight"


def groups_of(topo, features=()) -> dict:
    """{group name: Comm} for the world and every group of the topology with more than
    one rank (a group of one counts and moves nothing), DiLoCo's group across the
    replicas ("diloco", the outer all-reduce), and the communicators the step's features
    hold of their own (DiLoCo's averaged loss: "diloco_metrics"), under their names."""
    from numpitron.distributed.comm import Comm
    from numpitron.distributed.groups import GROUPS
    from numpitron.diloco.replicas import replicas_of
    found = {"world": topo.world, "embedding": topo.embedding_comm,
             **{name: getattr(topo, f"{name}_comm") for name in GROUPS}, "diloco": replicas_of(topo).comm}
    found.update({c.name: c for f in features for c in vars(f).values() if isinstance(c, Comm) and c.name not in found})
    seen, out = set(), {}
    for name, comm in found.items():
        if comm.size > 1 and id(comm) not in seen:
            seen.add(id(comm))
            out[name] = comm
    return out


class CommProbe:
    """Installed on a topology's communicators by `install`; `installed` says where."""

    def __init__(self, recorder, topo, features=()):
        self.rec, self.topo, self.features = recorder, topo, features
        self.counted = []          # (collective, bytes) the call in progress added to the counters
        self.busy = False          # inside a recorded call: a call it makes is its own part
        self.sent = {}             # (group, src, dst, tag) -> messages so far (sent or received): the arrows' keys
        self.patches = Patches()

    def install(self) -> None:
        def counting(add):
            def counting_add(collective, nbytes, seconds=0.0):
                add(collective, nbytes, seconds)
                if self.busy:
                    self.counted.append((collective, nbytes))
            return counting_add
        self.patches.wrap(self.topo.stats, "add", counting)
        for group, comm in groups_of(self.topo, self.features).items():
            world_of = self._world_ranks(comm)
            for method in BLOCKING + STARTING:
                self.patches.wrap(comm, method, partial(self._wrap, comm, group, method, world_of=world_of))
            self.patches.wrap(comm, "wait", partial(self._wait, group))
            self.patches.wrap(comm, "test", self._test)

    def uninstall(self) -> None:
        self.patches.undo()

    def _world_ranks(self, comm) -> list[int]:
        from mpi4py import MPI
        world = self.topo.job.mpi.Get_group()       # the job's ranks: with DiLoCo, every replica's
        return MPI.Group.Translate_ranks(comm.mpi.Get_group(), list(range(comm.size)), world)

    def _arrow(self, group: str, method: str, world_of, args, kwargs) -> tuple:
        """The key both ends of a message compute alike, (group, sender, receiver, tag, k)
        for the k-th such message (MPI keeps their order), and which end this is."""
        peer = kwargs.get(PEER[method], args[1] if len(args) > 1 else None)
        tag = kwargs.get("tag", args[2] if len(args) > 2 else 0)
        me, other = self.topo.job.rank, world_of[peer]
        src, dst = (me, other) if method in ("send", "isend") else (other, me)
        base = (group, src, dst, tag)
        k = self.sent[base] = self.sent.get(base, -1) + 1
        return base + (k,), "out" if src == me else "in"

    def _wrap(self, comm, group: str, method: str, call, world_of):
        rec, starting, message = self.rec, method in STARTING, method in PEER
        track = group + IN_FLIGHT if starting else group

        def traced(*args, **kwargs):
            if not rec.active or self.busy:
                return call(*args, **kwargs)
            self.busy = True
            self.counted.clear()
            start = now()
            try:
                result = call(*args, **kwargs)
            finally:
                end = now()
                self.busy = False
            counted = self.counted
            name = counted[0][0] if counted else f"{comm.name}.{method}"
            info = {"bytes": sum(n for _, n in counted), "group": group, "blocking": not starting,
                    "waited_ms": 0.0 if starting else (end - start) * 1e3, "hidden_ms": 0.0}
            span = rec.add(name, "comm", track, start, None if starting else end, info)
            if message:
                key, end_of_arrow = self._arrow(group, method, world_of, args, kwargs)
                rec.flow(end_of_arrow, key)
            if starting:
                pending = result[-1] if isinstance(result, tuple) else result      # iall_to_allv: (recv, it)
                pending.trace_span = span           # completed by `wait` or `test`
            return result
        return traced

    def _wait(self, group: str, call):
        rec = self.rec

        def traced(pending):
            span = getattr(pending, "trace_span", None)
            if span is None:
                return call(pending)
            start = now()
            call(pending)
            end = now()
            pending.trace_span = None
            if span[4] is None:
                span[4] = end
            span[5]["waited_ms"] += (end - start) * 1e3
            rec.add(span[0] + " wait", "wait", group, start, end, {"group": group})
        return traced

    def _test(self, call):
        def traced(pending):
            call(pending)
            for p in pending:
                span = getattr(p, "trace_span", None)
                if span is not None and p.done and span[4] is None:
                    span[4] = now()
        return traced
