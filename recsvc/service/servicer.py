"""The ``recsvc.v1.Recommender`` RPC handlers: validation, history lookup, batching, status mapping.

Status codes: user mistakes -> INVALID_ARGUMENT (never INTERNAL), history store down -> UNAVAILABLE
"history store unavailable" (the backend's detail, e.g. its host and port, goes to the server log only),
deadline passed -> DEADLINE_EXCEEDED and client cancellation -> CANCELLED (no traceback; queued work is
dropped before the engine call), queue full -> RESOURCE_EXHAUSTED, starting up or shutting down ->
UNAVAILABLE, a mode the engine does not implement -> UNIMPLEMENTED. Anything unexpected is logged with its
traceback and answered INTERNAL "internal error" without details; handlers never raise into gRPC.

Fewer than k items are never returned silently: ``fallback_reason`` says why (exclusions left fewer items,
or the engine returned fewer). ``stats`` reports what the engine did (``RecResult.decoding``): the mode used
beside the one requested, with the reason when they differ, the beam width, and N and gamma when it speculated.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import CancelledError as FutureCancelled
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from recsvc.errors import UserError
from recsvc.recommender.api import Decoding, Mode, Recommender, RecQuery, RecResult

from .batcher import Batcher, BatcherClosed, DeadlineExpired, Overloaded
from .gen import recommender_pb2 as pb
from .logs import EveryInterval, log_event
from .metrics import ServiceMetrics
from .stores import HistoryStore, HistoryStoreUnavailable
from .validation import MODE_TO_WIRE, Limits, check_user_id, validate_recommend, validate_record

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Recommender"].full_name  # "recsvc.v1.Recommender"
NO_HISTORY_REASON = "no_history: popular items"
STORE_UNAVAILABLE = "history store unavailable"  # the client's message; the detail is logged
_LOG_LEVEL = {
    grpc.StatusCode.INVALID_ARGUMENT: logging.INFO,
    grpc.StatusCode.CANCELLED: logging.INFO,
    grpc.StatusCode.DEADLINE_EXCEEDED: logging.INFO,
    grpc.StatusCode.INTERNAL: logging.ERROR,
}
_NO_DEADLINE = 1e8  # grpc reports a huge time_remaining() when the client set no deadline
# RecResult.decoding.mode -> Stats.mode; a result without decoding (a popularity table answered) is POPULARITY
DECODED_TO_WIRE = {**MODE_TO_WIRE, "sampling": pb.SAMPLING}
NO_DECODING_REASON = "no model decoding: popular items"  # a popularity-only server (--popularity)


class RpcCancelled(Exception):
    """The client cancelled the RPC (answered CANCELLED; the client no longer listens)."""


class NotReady(Exception):
    """The server is still starting (model loading, calibration): UNAVAILABLE, retry later."""


def shortfall_reason(returned: int, k: int, remaining: int, rules: bool = False) -> str:
    """Why ``returned`` < ``k`` items: ``remaining`` = how many catalog items the exclusions (and the rules)
    leave, capped at k."""
    after = "exclusions and rules" if rules else "exclusions"
    if remaining <= 0:
        return f"no items remain after {after}"
    if remaining < k:
        return f"only {remaining} items remain after {after}"
    return f"the engine returned {returned} of the {k} items asked for"


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


def _report_decoding(stats: pb.Stats, requested: Mode, decoding: Decoding | None, no_decoding_reason: str) -> str:
    """Fills ``stats`` with what decoded the request (None: nothing did, popular items answered, because of
    ``no_decoding_reason``); returns the mode used ("popularity" when none)."""
    stats.requested_mode = MODE_TO_WIRE[requested]
    if decoding is None:
        stats.mode = pb.POPULARITY
        stats.mode_fallback_reason = no_decoding_reason
        return "popularity"
    stats.mode = DECODED_TO_WIRE[decoding.mode]
    stats.beam_width = decoding.beam_width
    stats.draft_beams = decoding.draft_beams
    stats.gamma = decoding.gamma
    stats.mode_fallback_reason = decoding.fallback
    return decoding.mode


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
        exclude = set(args.exclude)
        excluding = (args.exclude_history if args.exclude_history is not None  # asked, else as served
                     else self.recommender.exclude_history)
        if excluding:
            exclude.update(history)
        response = pb.RecommendResponse()
        # how many items the exclusions (and the rules' filters and caps) leave, capped at k (a walk over the
        # catalog in popularity order)
        rules = args.rules
        if rules is not None and (rules.has_filters or rules.caps):
            remaining = len(self.recommender.popular_items(args.k, sorted(exclude), rules))
        else:
            remaining = len(self.recommender.popular_items(args.k, sorted(exclude))) if exclude else args.k
        reason, why_popular = "", NO_DECODING_REASON  # why_popular: the engine decoded nothing (no model)
        if not history or remaining == 0:
            if not remaining:
                items = []
            elif rules is not None:
                items = self.recommender.popular_items(args.k, sorted(exclude), rules)
            else:
                items = self.recommender.popular_items(args.k, sorted(exclude))
            result = RecResult(item_ids=list(items), scores=[0.0] * len(items))  # no decoding ran
            reason = NO_HISTORY_REASON if not history else ""
            why_popular = reason or shortfall_reason(0, args.k, 0, rules is not None)
            self.metrics.fallbacks.labels("no_history" if not history else "nothing_left").inc()
            batch_size = 0
        else:
            query = RecQuery(
                history=tuple(history),
                k=args.k,
                mode=args.mode,
                exclude=tuple(sorted(exclude)),
                temperature=args.temperature,
                seed=args.seed,
                rules=rules,
                exclude_history=excluding,
            )
            outcome = self._compute(query, context)
            result, batch_size = outcome.result, outcome.batch_size
        if len(result.item_ids) < args.k:
            short = shortfall_reason(len(result.item_ids), args.k, remaining, rules is not None)
            reason = f"{reason}; {short}" if reason else short
            if history and remaining > 0:  # (remaining == 0 was counted as "nothing_left")
                self.metrics.fallbacks.labels("short").inc()
        response.fallback_reason = reason
        if reason:
            fields["reason"] = reason
        for item_id, score in zip(result.item_ids, result.scores, strict=True):
            response.items.add(
                item_id=item_id, score=score, semantic_id=self.recommender.semantic_id(item_id)
            )
        used = _report_decoding(response.stats, args.mode, result.decoding, why_popular)
        self.metrics.modes.labels(used, args.mode).inc()
        stats = result.stats
        response.stats.target_forward_calls = stats.target_calls
        response.stats.draft_forward_calls = stats.draft_calls
        response.stats.accepted_steps = stats.accepted_steps
        response.stats.batch_size = batch_size
        response.stats.server_ms = (time.perf_counter() - started) * 1000.0
        self.metrics.target_calls.inc(stats.target_calls)
        self.metrics.draft_calls.inc(stats.draft_calls)
        self.metrics.accepted_steps.inc(stats.accepted_steps)
        if stats.host_reads >= 0:
            self.metrics.host_reads.inc(stats.host_reads)
        fields.update(mode=args.mode, mode_used=used, k=args.k, items=len(result.item_ids), batch_size=batch_size)
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
        return pb.GetHistoryResponse(item_ids=items)

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

    def _compute(self, query: RecQuery, context: grpc.ServicerContext):
        remaining = context.time_remaining()
        has_deadline = remaining is not None and remaining < _NO_DEADLINE
        wait_s = remaining if has_deadline else self.request_timeout_s
        deadline = time.monotonic() + wait_s
        if not context.is_active():  # cancelled or expired before the handler got here: never queued
            try:
                self._raise_ended(context, has_deadline, deadline)
            except DeadlineExpired:
                self.metrics.expired.labels("deadline").inc()
                raise
            except RpcCancelled:
                self.metrics.expired.labels("cancelled").inc()
                raise
        future = self.batcher.submit(query, deadline)
        if not context.add_callback(future.cancel):  # client gone -> the batcher skips the query
            future.cancel()  # the RPC ended between is_active() and add_callback(): no callback will come
        try:
            return future.result(timeout=max(wait_s, 0.0))
        except FutureTimeout:
            future.cancel()
            raise DeadlineExpired("deadline exceeded while the query was being computed") from None
        except FutureCancelled:  # the RPC ended (cancelled or expired) and its callback cancelled the future
            self._raise_ended(context, has_deadline, deadline)

    @staticmethod
    def _raise_ended(context: grpc.ServicerContext, has_deadline: bool, deadline: float) -> None:
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
