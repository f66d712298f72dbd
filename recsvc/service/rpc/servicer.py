"""The ``recsvc.v1.Recommender`` RPC handlers: validation, history lookup, batching, status mapping.

Status codes: user mistakes -> INVALID_ARGUMENT (never INTERNAL), history store down -> UNAVAILABLE
"history store unavailable" (the backend's detail, e.g. its host and port, goes to the server log only),
deadline passed -> DEADLINE_EXCEEDED and client cancellation -> CANCELLED (no traceback; queued work is
dropped before the engine call), queue full -> RESOURCE_EXHAUSTED, starting up or shutting down ->
UNAVAILABLE, a mode the engine does not implement -> UNIMPLEMENTED. Anything unexpected is logged with its
traceback and answered INTERNAL "internal error" without details; handlers never raise into gRPC.

A request becomes one ``RecQuery`` (``RecommendArgs.query_for``), handed to the batcher by one call that returns
its ``Answer`` (``recsvc.recommender.answer``): the result, why it holds fewer than k items (``fallback_reason``:
no history, exclusions left fewer items, or the engine returned fewer) and, when no model decoded it, why. The
response is filled from that record alone, each item with its key when the catalog has one (item keys on the
wire are translated to numbers by ``validation``; stored histories hold numbers). ``stats`` reports what the
engine did (``RecResult.decoding``): the mode used beside the one requested, with the reason when they differ,
the beam width, and N and gamma when it speculated.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import CancelledError as FutureCancelled
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError, Message

from recsvc.errors import UserError
from recsvc.recommender.api import Mode, Recommender, RecQuery
from recsvc.service.gen import recommender_pb2 as pb
from recsvc.service.observability.logs import EveryInterval, log_event
from recsvc.service.observability.metrics import ServiceMetrics
from recsvc.service.stores import HistoryStore, HistoryStoreUnavailable
from recsvc.service.swap.call_activity import CallActivity

from .batcher import Batcher, BatcherClosed, BatchOutcome, DeadlineExpired, Overloaded
from .validation import MODE_TO_WIRE, Limits, check_user_id, validate_recommend, validate_record

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Recommender"].full_name  # "recsvc.v1.Recommender"
STORE_UNAVAILABLE = "history store unavailable"  # the client's message; the detail is logged
_LOG_LEVEL = {
    grpc.StatusCode.INVALID_ARGUMENT: logging.INFO,
    grpc.StatusCode.CANCELLED: logging.INFO,
    grpc.StatusCode.DEADLINE_EXCEEDED: logging.INFO,
    grpc.StatusCode.INTERNAL: logging.ERROR,
}
_NO_DEADLINE = 1e8  # grpc reports a huge time_remaining() when the client set no deadline
# Decoding.mode -> Stats.mode; a result without decoding (popular items answered) is POPULARITY
DECODED_TO_WIRE = {**MODE_TO_WIRE, "sampling": pb.SAMPLING}


class RpcCancelled(Exception):
    """The client cancelled the RPC (answered CANCELLED; the client no longer listens)."""


class NotReady(Exception):
    """The server is still starting (model loading, calibration): UNAVAILABLE, retry later."""


@dataclass(frozen=True)
class _Malformed:
    """What the deserializer returns for bytes that are not a valid message (answered INVALID_ARGUMENT)."""

    error: str


def _lenient(message_type: type[Message]) -> Callable[[bytes], Message | _Malformed]:
    def parse(data: bytes) -> Message | _Malformed:
        try:
            return message_type.FromString(data)
        except (DecodeError, ValueError, RuntimeError) as exc:
            return _Malformed(str(exc) or type(exc).__name__)

    return parse


class RecommenderServicer:
    """Serves Recommend / RecordInteractions / GetHistory on top of a recommender, a store and a batcher."""

    def __init__(
        self,
        recommender: Recommender | None,
        store: HistoryStore,
        batcher: Batcher | None,
        *,
        limits: Limits,
        default_mode: Mode,
        metrics: ServiceMetrics,
        request_timeout_s: float = 30.0,
        on_store_state: Callable[[bool, str], None] | None = None,
    ) -> None:
        """``recommender`` / ``batcher`` may be None while the server starts (RPCs: UNAVAILABLE) until
        :meth:`attach`. ``on_store_state(ok, detail)`` hears every history-store success / failure."""
        self.recommender = recommender
        self.store = store
        self.batcher = batcher
        self.limits = limits
        self.default_mode = default_mode
        self.metrics = metrics
        self.request_timeout_s = request_timeout_s
        self.on_store_state = on_store_state
        self.after_record: Callable[[str], None] | None = None  # called with the user id after a stored write
        self._rejections = EveryInterval(1.0)  # a burst of rejected calls: one log line a second, with a count
        self.activity = CallActivity()  # calls being answered: a bundle loading beside this one yields to them

    def attach(self, recommender: Recommender, batcher: Batcher) -> None:
        """The engine is ready: serve RPCs from now on."""
        self.recommender = recommender
        self.batcher = batcher

    def generic_handler(self) -> grpc.GenericRpcHandler:
        """Method handlers with lenient deserializers (malformed bytes -> INVALID_ARGUMENT, not INTERNAL)."""

        def unary(
            fn: Callable, request_type: type[Message], response_type: type[Message]
        ) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(
                fn,
                request_deserializer=_lenient(request_type),
                response_serializer=response_type.SerializeToString,
            )

        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Recommend": unary(self.Recommend, pb.RecommendRequest, pb.RecommendResponse),
                "RecordInteractions": unary(
                    self.RecordInteractions, pb.RecordInteractionsRequest, pb.RecordInteractionsResponse
                ),
                "GetHistory": unary(self.GetHistory, pb.GetHistoryRequest, pb.GetHistoryResponse),
            },
        )

    # --- RPCs -------------------------------------------------------------------------------------------

    def Recommend(self, request: Any, context: grpc.ServicerContext) -> pb.RecommendResponse:  # noqa: N802
        return self._serve("Recommend", request, context, self._recommend, pb.RecommendResponse)

    def RecordInteractions(
        self, request: Any, context: grpc.ServicerContext
    ) -> pb.RecordInteractionsResponse:  # noqa: N802
        return self._serve(
            "RecordInteractions", request, context, self._record, pb.RecordInteractionsResponse
        )

    def GetHistory(self, request: Any, context: grpc.ServicerContext) -> pb.GetHistoryResponse:  # noqa: N802
        return self._serve("GetHistory", request, context, self._get_history, pb.GetHistoryResponse)

    # --- implementations ----------------------------------------------------------------------------------

    def _recommend(
        self, request: pb.RecommendRequest, context: grpc.ServicerContext, fields: dict
    ) -> Message:
        started = time.perf_counter()
        args = validate_recommend(request, self.recommender, self.limits, self.default_mode)
        if args.inline_history:
            history, fields["history"] = list(args.inline_history), "inline"
        else:
            history, fields["history"] = self._stored_history(args.user_id), "stored"
        query = args.query_for(history, self.recommender.exclude_history)
        outcome = self._compute(query, context)
        answer, result = outcome.answer, outcome.answer.result
        if answer.fallback:
            self.metrics.fallbacks.labels(answer.fallback).inc()
        response = pb.RecommendResponse(fallback_reason=answer.reason)
        if answer.reason:
            fields["reason"] = answer.reason
        for item_id, score in zip(result.item_ids, result.scores, strict=True):
            response.items.add(
                item_id=item_id, score=score, semantic_id=self.recommender.semantic_id(item_id),
                key=self.recommender.key_of(item_id) or "",
            )
        # what decoded the request (none: popular items answered, answer.not_decoded says why)
        stats, decoding = response.stats, result.decoding
        stats.requested_mode = MODE_TO_WIRE[query.mode]
        if decoding is None:
            stats.mode, stats.mode_fallback_reason, used = pb.POPULARITY, answer.not_decoded, "popularity"
        else:
            stats.mode, stats.mode_fallback_reason = DECODED_TO_WIRE[decoding.mode], decoding.fallback
            used = decoding.mode
            stats.beam_width = decoding.beam_width
            stats.draft_beams = decoding.draft_beams
            stats.gamma = decoding.gamma
        self.metrics.modes.labels(used, query.mode).inc()
        counts = result.stats
        stats.target_forward_calls = counts.target_calls
        stats.draft_forward_calls = counts.draft_calls
        stats.accepted_steps = counts.accepted_steps
        stats.batch_size = outcome.batch_size
        stats.server_ms = (time.perf_counter() - started) * 1000.0
        self.metrics.target_calls.inc(counts.target_calls)
        self.metrics.draft_calls.inc(counts.draft_calls)
        self.metrics.accepted_steps.inc(counts.accepted_steps)
        if counts.host_reads >= 0:
            self.metrics.host_reads.inc(counts.host_reads)
        fields.update(mode=query.mode, mode_used=used, k=query.k, items=len(result.item_ids),
                      batch_size=outcome.batch_size)
        return response

    def _record(
        self, request: pb.RecordInteractionsRequest, context: grpc.ServicerContext, fields: dict
    ) -> Message:
        user_id, items = validate_record(request, self.recommender, self.limits)
        length = self._store_call("append", lambda: self.store.append(user_id, items))
        fields.update(items=len(items), history_length=length)
        if self.after_record is not None:  # e.g. the user's prefill, ahead, when the engine is idle
            self.after_record(user_id)
        return pb.RecordInteractionsResponse(history_length=length)

    def _get_history(
        self, request: pb.GetHistoryRequest, context: grpc.ServicerContext, fields: dict
    ) -> Message:
        user_id = check_user_id(request.user_id, self.limits)
        items = self._store_call("get", lambda: self.store.get(user_id))
        fields["items"] = len(items)
        rec = self.recommender
        keys = [rec.key_of(item) or "" for item in items] if rec.has_item_keys else []
        return pb.GetHistoryResponse(item_ids=items, item_keys=keys)

    def _stored_history(self, user_id: str) -> list[int]:
        """The newest ``max_history`` stored items still in the catalog (a new bundle may drop items)."""
        items = self._store_call("get", lambda: self.store.get(user_id))
        return [item for item in items if self.recommender.known_item(item)][-self.limits.max_history :]

    def _store_call(self, operation: str, fn: Callable[[], Any]) -> Any:
        try:
            value = fn()
        except HistoryStoreUnavailable as exc:
            self.metrics.store_errors.labels(operation).inc()
            if self.on_store_state is not None:
                self.on_store_state(False, str(exc))
            raise
        if self.on_store_state is not None:
            self.on_store_state(True, "")
        return value

    def _compute(self, query: RecQuery, context: grpc.ServicerContext) -> BatchOutcome:
        """``query``'s answer within the RPC's deadline (else the request timeout); skipped once the RPC ends."""
        remaining = context.time_remaining()
        has_deadline = remaining is not None and remaining < _NO_DEADLINE
        deadline = time.monotonic() + (remaining if has_deadline else self.request_timeout_s)
        if not context.is_active():  # cancelled or expired before the handler got here: never queued
            try:
                self._raise_ended(context, has_deadline, deadline)
            except DeadlineExpired:
                self.metrics.expired.labels("deadline").inc()
                raise
            except RpcCancelled:
                self.metrics.expired.labels("cancelled").inc()
                raise
        try:  # the client gone (context's callback): the query is skipped
            return self.batcher.answer(query, deadline, context.add_callback)
        except FutureCancelled:  # the RPC ended (cancelled or expired) and its callback cancelled the query
            self._raise_ended(context, has_deadline, deadline)

    @staticmethod
    def _raise_ended(context: grpc.ServicerContext, has_deadline: bool, deadline: float) -> NoReturn:
        """The RPC is over: DeadlineExpired when its deadline has passed, else RpcCancelled."""
        late = time.monotonic() >= deadline - 0.002
        if late or (has_deadline and (context.time_remaining() or 0.0) <= 0.002):
            raise DeadlineExpired("deadline exceeded") from None
        raise RpcCancelled("cancelled by the client") from None

    # --- status mapping -------------------------------------------------------------------------------------

    def _serve(self, method: str, request: Any, context: grpc.ServicerContext, fn: Callable, response_type):
        started = time.perf_counter()
        fields: dict[str, Any] = {}
        code, message = grpc.StatusCode.OK, ""
        rejected = None  # turned away before any work: starting | overloaded | closing
        try:
            if self.batcher is None or self.recommender is None:
                raise NotReady("server is starting up")
            if isinstance(request, _Malformed):
                raise UserError(f"malformed {method} request: {request.error}")
            with self.activity.call():
                response = fn(request, context, fields)
        except UserError as exc:
            code, message = grpc.StatusCode.INVALID_ARGUMENT, str(exc)
        except HistoryStoreUnavailable as exc:
            code, message = grpc.StatusCode.UNAVAILABLE, STORE_UNAVAILABLE
            fields["detail"] = str(exc)  # e.g. "Error 111 connecting to 127.0.0.1:6391": the log only
        except NotReady as exc:
            code, message, rejected = grpc.StatusCode.UNAVAILABLE, str(exc), "starting"
        except DeadlineExpired as exc:
            code, message = grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)
        except (RpcCancelled, FutureCancelled):
            code, message = grpc.StatusCode.CANCELLED, "cancelled by the client"
        except Overloaded as exc:
            code, message, rejected = grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), "overloaded"
        except BatcherClosed as exc:
            code, message, rejected = grpc.StatusCode.UNAVAILABLE, str(exc), "closing"
        except NotImplementedError as exc:  # e.g. a decoding mode this engine build does not offer
            code, message = grpc.StatusCode.UNIMPLEMENTED, f"not supported by this engine: {exc}"
        except Exception:
            log.exception("unexpected error in %s", method)
            code, message = grpc.StatusCode.INTERNAL, "internal error"
        elapsed = time.perf_counter() - started
        self.metrics.latency.labels(method).observe(elapsed)
        self.metrics.requests.labels(method, code.name).inc()
        level = logging.INFO
        if code != grpc.StatusCode.OK:
            self.metrics.errors.labels(method, code.name).inc()
            fields["error"] = message
            level = _LOG_LEVEL.get(code, logging.WARNING)
        if rejected is not None:
            self.metrics.rejected.labels(method, rejected).inc()
            fields["count"] = self._rejections.admit((method, rejected))  # calls this line stands for
        if rejected is None or fields["count"]:
            log_event(log, "rpc", level, method=method, code=code.name, ms=round(elapsed * 1000.0, 3), **fields)
        if code != grpc.StatusCode.OK:
            # abort, not set_code + return: the status goes out as a trailers-only response, which a client's
            # retry policy may replay (UNAVAILABLE from a starting or store-less replica goes to another one);
            # a status after response headers is committed and never retried.
            context.abort(code, message)
        return response
