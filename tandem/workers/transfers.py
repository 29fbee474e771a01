"""A worker's part in KV handoffs: as a prefill worker it sends each prefilled request's
KV to the decode worker the broker chose and reports the outcome; as a decode worker it
admits or refuses incoming transfers and hands completed ones to its engine. Part of
:class:`tandem.workers.worker.Worker` (its state lives there); the connections and
framing are :mod:`tandem.workers.sender` and :mod:`tandem.workers.handoff`.
"""

from __future__ import annotations

import logging

from tandem.pipeline.api import EngineRefused
from tandem.wire import messages as M
from tandem.workers.local import Local

log = logging.getLogger("tandem.worker")


class KVHandoffs:
    # ---- prefill side ---------------------------------------------------------------------
    def _hand_off(self, local: Local, snap) -> None:
        local.handing_off = True
        self.sender.start(snap, attempt=local.attempt, decode_node=local.decode_node or "",
                          address=local.decode_address, stream_seq=local.seq, priority=local.priority)

    def _handoff_outcomes(self, outcomes) -> None:
        for rid, failure in outcomes:
            if self.gate is not None:
                self.gate.prompt_done(rid)
            local = self.local.get(rid)
            if local is None or not local.handing_off:
                continue
            del self.local[rid]
            if failure is None:
                self._send(M.Done(rid, None, None, handed_to=local.decode_node or "decode"))
            else:
                log.info("handoff of %s failed: %s", rid.hex(), failure)
                # The broker moves the request on (excluding that decode worker); the first
                # token is already out, so it continues from it.
                self._send(M.Refused(rid, "at_capacity", failure[:1000], 0.0))

    # ---- decode side ----------------------------------------------------------------------
    def _at_capacity(self) -> bool:
        return self._draining or len(self.local) >= self.capacity

    def _on_kv_in(self, frames) -> None:
        for peer, attempt, header, snap in self.kv_in.on_message(list(frames), at_capacity=self._at_capacity):
            rid = header.request_id
            if snap is None:
                refuse = None
                if rid in self.tombstones:
                    refuse = ("invalid", "request was aborted")
                elif self._draining:
                    refuse = ("draining", "decode worker is draining")
                elif header.model != self.model_id:
                    refuse = ("invalid", f"decode worker serves {self.model_id!r}, KV is for {header.model!r}")
                elif len(self.local) >= self.capacity or not self.engine.can_accept(len(header.tokens)):
                    refuse = ("at_capacity", "decode worker is full")
                if refuse:
                    self.kv_in.refuse(peer, rid, refuse[0], refuse[1], 0.5)
                    continue
                self.kv_in.reply(peer, M.KVAck(rid, complete=False))
                # Hold the place now so capacity counts the transfer in flight.
                self.local[rid] = Local(rid, attempt, header.stream_seq, "run", header.prompt_len, header.priority)
                continue
            local = self.local.get(rid)
            if local is None or local.attempt != attempt:
                self.kv_in.refuse(peer, rid, "invalid", "request was aborted")
                continue
            try:
                self.engine.import_kv(snap, self._callback(attempt), priority=header.priority)
            except (EngineRefused, ValueError) as exc:
                del self.local[rid]
                self.kv_in.refuse(peer, rid, "at_capacity" if isinstance(exc, EngineRefused) else "invalid",
                                  str(exc)[:500], getattr(exc, "retry_after_s", 0.0))
                continue
            self.kv_in.reply(peer, M.KVAck(rid, complete=True))
            self.mark("kv_ingested", rid)

    def _expire_transfers(self, now: float) -> None:
        """Both sides' timeouts: an unacknowledged send fails its request; a transfer whose
        data never completed gives its place back."""
        self._handoff_outcomes(self.sender.expired(now))
        if self.kv_in is not None:
            for inc in self.kv_in.expire(now):
                local = self.local.get(inc.header.request_id)
                if local is not None and local.attempt == inc.attempt:
                    del self.local[inc.header.request_id]
