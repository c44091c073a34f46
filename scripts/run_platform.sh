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
# What the settings make of the environment: the model's directory, the name clients ask for, auth.
{ read -r model_path; read -r model_name; read -r auth_required; } < <($PY -c "
import os, pathlib, django
os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'inference_platform.settings')
django.setup()
from django.conf import settings as s
print(s.MODEL_PATH, s.MODEL_NAME or pathlib.Path(s.MODEL_PATH).resolve().name, int(s.API_AUTH_REQUIRED), sep='\n')")
if [ ! -f "$model_path/config.json" ]; then
  echo "Building the demo model at $model_path (random weights, local tokenizer)..."
  $PY manage.py build_demo_model "$model_path"
fi
$PY manage.py ensure_admin
# A key for the demo tenant, printed once (like the admin password); afterwards only its prefix.
$PY manage.py ensure_demo_key
if [ "$auth_required" != "1" ]; then
  cat <<'WARN'

  !!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
  !!  API AUTHENTICATION IS OFF (API_AUTH_REQUIRED=0): anyone who reaches this server can   !!
  !!  call every /v1/ endpoint, the operators' ones included. Only for a local demo.          !!
  !!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
WARN
fi

cat <<MSG

  API:        http://$WEB_HOST:$WEB_PORT/v1/chat/completions   (docs: http://$WEB_HOST:$WEB_PORT/v1/docs)
  Admin:      http://$WEB_HOST:$WEB_PORT/admin/   (the admin login printed above the first time; tenants, keys, usage)
  Dashboard:  http://$WEB_HOST:$WEB_PORT/admin/dashboard/
  Health:     http://$WEB_HOST:$WEB_PORT/ready   (200 once a worker has loaded the model: a few seconds)
  Metrics:    http://$WEB_HOST:$WEB_PORT/metrics   (with the demo key: it is an operator's key)
  Try:        export API_KEY=<the demo key, printed above the first time>
              curl -s http://$WEB_HOST:$WEB_PORT/v1/chat/completions -H 'Content-Type: application/json' \\
                -H "Authorization: Bearer \$API_KEY" \\
                -d '{"model": "$model_name", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}'
  Stop:       Ctrl-C

MSG
exec_status=0
.venv/bin/honcho start -f Procfile || exec_status=$?
# honcho answers Ctrl-C (SIGINT) with 130 and SIGTERM with 143 once everything it started has
# stopped: that is the way out, not an error for make to report.
case $exec_status in 130|143) echo "Stopped."; exec_status=0;; esac
exit $exec_status
