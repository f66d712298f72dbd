#!/bin/bash
# The container's entrypoint: `recsvc serve` with its flags taken from RECSVC_* environment variables (a
# Kubernetes ConfigMap, `docker run -e`), then any container arguments (`docker run IMAGE --spec 10:3`), which
# come last and so win over the environment.
#
#   RECSVC_BUNDLE (default /models/bundle) or RECSVC_POPULARITY   -> --bundle / --popularity
#   RECSVC_HOST (default 0.0.0.0), RECSVC_GRPC_PORT (default 50051) -> --host, --port
#   RECSVC_<FLAG> for the other `recsvc serve` flags below (unset or empty = the flag's default);
#   RECSVC_EXCLUDE_HISTORY / RECSVC_NO_PRIOR: true|false; RECSVC_EXTRA_ARGS: more flags, split on spaces.
# RECSVC_API_KEY is read by recsvc itself (never put on the command line, so it stays out of `ps`).
# The port variable is RECSVC_GRPC_PORT, not RECSVC_PORT: Kubernetes' service links define RECSVC_PORT
# (tcp://...) in every pod of a namespace holding a Service named "recsvc".
set -euo pipefail

args=()
if [[ -n "${RECSVC_POPULARITY:-}" ]]; then
    args+=(--popularity "$RECSVC_POPULARITY")
else
    args+=(--bundle "${RECSVC_BUNDLE:-/models/bundle}")
fi
args+=(--host "${RECSVC_HOST:-0.0.0.0}" --port "${RECSVC_GRPC_PORT:-50051}")

opt() {  # opt VARIABLE --flag: adds "--flag value" when $VARIABLE is set and not empty
    local value="${!1:-}"
    if [[ -n "$value" ]]; then args+=("$2" "$value"); fi
}
switch() {  # switch VARIABLE --flag: adds "--flag" when $VARIABLE is true
    case "${!1:-}" in
        1 | true | True | TRUE | yes) args+=("$2") ;;
        "" | 0 | false | False | FALSE | no) ;;
        *) echo "error: $1 must be true or false, got '${!1}'" >&2; exit 2 ;;
    esac
}

opt RECSVC_METRICS_PORT --metrics-port
if [[ -n "${RECSVC_METRICS_PORT:-}" ]]; then args+=(--metrics-host "${RECSVC_METRICS_HOST:-0.0.0.0}"); fi
opt RECSVC_DTYPE --dtype
opt RECSVC_REDIS_URL --redis-url
opt RECSVC_REDIS_TTL_S --redis-ttl-s
opt RECSVC_REDIS_PREFIX --redis-prefix
opt RECSVC_REDIS_WAIT_REPLICAS --redis-wait-replicas
opt RECSVC_REDIS_WAIT_TIMEOUT_MS --redis-wait-timeout-ms
opt RECSVC_MAX_BATCH --max-batch
opt RECSVC_MAX_WAIT_MS --max-wait-ms
opt RECSVC_DEFAULT_MODE --default-mode
opt RECSVC_TLS_CERT --tls-cert
opt RECSVC_TLS_KEY --tls-key
opt RECSVC_MAX_K --max-k
opt RECSVC_MAX_HISTORY --max-history
opt RECSVC_MAX_MESSAGE_BYTES --max-message-bytes
opt RECSVC_WORKERS --workers
opt RECSVC_GRACE_S --grace-s
opt RECSVC_LOG_LEVEL --log-level
opt RECSVC_ATTENTION --attention
opt RECSVC_DRAFTER --drafter
opt RECSVC_BEAM_WIDTH --beam-width
opt RECSVC_SPEC --spec
opt RECSVC_STARTUP_BUDGET_S --startup-budget-s
opt RECSVC_CATALOG --catalog
opt RECSVC_BUNDLE_WATCH_S --bundle-watch-s
switch RECSVC_EXCLUDE_HISTORY --exclude-history
switch RECSVC_NO_PRIOR --no-prior
if [[ -n "${RECSVC_EXTRA_ARGS:-}" ]]; then
    read -r -a extra <<<"$RECSVC_EXTRA_ARGS"
    args+=("${extra[@]}")
fi

exec recsvc serve "${args[@]}" "$@"
