#!/usr/bin/env bash
# `make run`: Redis if none answers, migrations, the demo model and an admin login if missing,
# then the ASGI server and two workers under honcho. Ctrl-C stops everything it started.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export WEB_HOST="${WEB_HOST:-127.0.0.1}" WEB_PORT="${WEB_PORT:-8000}"
export WORKER_TORCH_THREADS="${WORKER_TORCH_THREADS:-1}"

rm -f var/redis.pid
bash scripts/ensure_redis.sh --owned
cleanup() {
  if [ -f var/redis.pid ]; then kill "$(cat var/redis.pid)" 2>/dev/null || true; rm -f var/redis.pid; fi
}
trap cleanup EXIT

$PY manage.py migrate --noinput -v 0
model_path=$($PY -c "import django,os;os.environ.setdefault('DJANGO_SETTINGS_MODULE','inference_platform.settings');django.setup();from django.conf import settings;print(settings.MODEL_PATH)")
if [ ! -f "$model_path/config.json" ]; then
  echo "Building the demo model at $model_path (random weights, local tokenizer)..."
  $PY manage.py build_demo_model "$model_path"
fi
$PY manage.py ensure_admin
# A key for the demo tenant, printed once (like the admin password); afterwards only its prefix.
$PY manage.py ensure_demo_key
auth_required=$($PY -c "import django,os;os.environ.setdefault('DJANGO_SETTINGS_MODULE','inference_platform.settings');django.setup();from django.conf import settings;print(int(settings.API_AUTH_REQUIRED))")
if [ "$auth_required" != "1" ]; then
  cat <<'WARN'

  !!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
  !!  API AUTHENTICATION IS OFF (API_AUTH_REQUIRED=0): anyone who reaches this server can   !!
  !!  call every /v1/ endpoint, the operators' ones included. Only for a local demo.          !!
  !!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
WARN
fi

cat <<MSG

  API:    http://$WEB_HOST:$WEB_PORT/v1/chat/completions   (models: http://$WEB_HOST:$WEB_PORT/v1/models)
  Admin:  http://$WEB_HOST:$WEB_PORT/admin/   (tenants, API keys, limits, usage)
  Try:    export API_KEY=<the demo key printed above>
          curl -s http://$WEB_HOST:$WEB_PORT/v1/chat/completions -H 'Content-Type: application/json' \\
            -H "Authorization: Bearer \$API_KEY" \\
            -d '{"model": "$(basename "$model_path")", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}'

MSG
exec_status=0
.venv/bin/honcho start -f Procfile || exec_status=$?
exit $exec_status
