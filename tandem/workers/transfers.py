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
    def _plan_handoff(self, local: Local) -> bool:
        """At dispatch: a prompt of several prefill chunks gets its strategy now, and with
        Streamed its KV goes to the decode worker chunk by chunk while the prefill runs, so
        only the last chunk's blocks are left to move once the first token is out (a long
        prompt's handoff hides behind its own prefill). Returns whether it streams."""
        settings = getattr(self.engine, "settings", None)
        chunk = getattr(settings, "prefill_chunk_size", 0)
        if not chunk or local.prompt_len <= chunk or self.sender is None:
            return False  # one chunk: nothing to overlap; the strategy is chosen at the handoff
        nbytes = -(-local.prompt_len // settings.block_size) * getattr(self.engine, "bytes_per_block", 0)
        local.strategy = self.sender.choose(local.decode_address, nbytes, streaming=True)
        local.stream_kv = local.strategy == "streamed"
        return local.stream_kv

    def _stream_part(self, local: Local, part) -> None:
        if local.kv_failed is None:
            self.sender.stream(part, final=False, attempt=local.attempt, decode_node=local.decode_node or "",
                               address=local.decode_address, stream_seq=local.seq, priority=local.priority)

    def _hand_off(self, local: Local, snap) -> None:
        local.handing_off = True
        if local.kv_failed is not None:
            self._handoff_outcomes([(local.request_id, local.kv_failed)])
        elif local.stream_kv:
            self.sender.stream(snap, final=True, attempt=local.attempt, decode_node=local.decode_node or "",
                               address=local.decode_address, stream_seq=local.seq, priority=local.priority)
        else:
            self.sender.start(snap, attempt=local.attempt, decode_node=local.decode_node or "",
                              address=local.decode_address, stream_seq=local.seq, priority=local.priority,
                              strategy=local.strategy)

    def _handoff_outcomes(self, outcomes) -> None:
        for rid, failure in outcomes:
            local = self.local.get(rid)
            if local is not None and local.stream_kv and not local.handing_off:
                # Streamed and still prefilling: the failure is reported once the first token is
                # out (_hand_off), so the broker blames the decode target and continues from it.
                local.kv_failed = local.kv_failed or failure
                continue
            if self.gate is not None:
                self.gate.prompt_done(rid)
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
        arrivals = self.kv_in.on_message(list(frames), at_capacity=self._at_capacity)
        self._forward_parts()  # before a completed transfer's final part
        for peer, attempt, header, snap in arrivals:
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
                if rid in self.local:
                    self.engine.abort(rid)  # a newer attempt replaces what an older one left here
                self.kv_in.reply(peer, M.KVAck(rid, complete=False))
                # Hold the place now so capacity counts the transfer in flight.
                local = self.local[rid] = Local(rid, attempt, header.stream_seq, "run", header.prompt_len,
                                                header.priority, receiving=True, kv_peer=peer)
                if not header.final and header.block_size == self.block_size:
                    # Opened while its prompt is prefilled (Streamed): the engine reserves
                    # the blocks now and each part goes into its KV store as it comes, so the
                    # final part leaves only its own blocks to copy (_import_event hears if
                    # it could not reserve them).
                    try:
                        self.engine.reserve_kv(rid, header.num_computed, self._callback(attempt), priority=header.priority)
                    except ValueError as exc:  # a model on dense caches imports no KV
                        self._refuse_import(local, "invalid", str(exc))
                        continue
                    self.kv_in.import_progressively(rid)
                continue
            local = self.local.get(rid)
            if local is None or local.attempt != attempt:
                self.kv_in.refuse(peer, rid, "invalid", "request was aborted")
                continue
            local.seq = header.stream_seq  # the final header's: after the first token
            local.receiving = False
            local.kv_peer = peer
            try:
                # The whole snapshot: with its reservation held the engine copies only the
                # blocks no part brought; without (refused meanwhile) it imports it all.
                self.engine.import_kv(snap, self._callback(attempt), priority=header.priority)
            except (EngineRefused, ValueError) as exc:
                self._refuse_import(local, "at_capacity" if isinstance(exc, EngineRefused) else "invalid", str(exc),
                                    getattr(exc, "retry_after_s", 0.0))
                continue
            self.kv_in.reply(peer, M.KVAck(rid, complete=True))
            self.mark("kv_ingested", rid)

    def _forward_parts(self) -> None:
        for attempt, part in self.kv_in.take_parts():
            local = self.local.get(part.request_id)
            if local is None or local.attempt != attempt or not local.receiving:
                continue  # aborted or replaced here: the engine dropped its reservation
            try:
                self.engine.import_part(part)
            except ValueError as exc:
                self._refuse_import(local, "invalid", str(exc))
                continue
            self.mark("kv_part_in", part.request_id, first_block=part.first_block, blocks=len(part.keys[0]))

    def _import_event(self, local: Local, ev) -> bool:
        """Decode side: True when ``ev`` is the engine's answer to a streamed import's
        reservation (nothing to publish). No room for the blocks (or a part that did not
        follow) while the KV still arrives: the transfer is refused (backpressure), and the
        prefill worker reports it after the first token, so the broker continues the
        request elsewhere. Once all of it is in, the engine imports it whole instead."""
        if ev.kv_reserved is None:
            return False
        if not ev.kv_reserved and local.receiving:
            self._refuse_import(local, "at_capacity", ev.error or "no room for the KV", 0.5)
        return True

    def _refuse_import(self, local: Local, reason: str, why: str, retry_after: float = 0.0) -> None:
        """Drop a transfer this worker will not run, with whatever the engine holds for it."""
        del self.local[local.request_id]
        self.engine.abort(local.request_id)  # frees a reservation; nothing for a whole import
        self.kv_in.refuse(local.kv_peer, local.request_id, reason, why[:500], retry_after)

    def _expire_transfers(self, now: float) -> None:
        """Both sides' timeouts: an unacknowledged send fails its request; a transfer whose
        data never completed (timed out, cancelled by its sender, cut off with its
        connection, replaced by a newer attempt's) gives its place and its reserved blocks
        back."""
        self._handoff_outcomes(self.sender.expired(now))
        if self.kv_in is not None:
            for inc in self.kv_in.expire(now):
                local = self.local.get(inc.header.request_id)
                if local is not None and local.attempt == inc.attempt and local.receiving:
                    del self.local[inc.header.request_id]
                    self.engine.abort(inc.header.request_id)
