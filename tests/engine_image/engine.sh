#!/bin/sh
# A stand-in for `vllm serve` as m31ctl sees it: the same argv, phase lines in the log, then
# /health and /v1/models on port 8000. FAKE_ENGINE_MODE: ready | oom | hang | crashloop.
mode=${FAKE_ENGINE_MODE:-ready}
delay=${FAKE_ENGINE_DELAY:-2}
served=""
prev=""
for arg in "$@"; do
  if [ "$prev" = "--served-model-name" ]; then served=$arg; fi
  prev=$arg
done
child=""
trap 'echo "INFO Shutting down: draining requests"; [ -n "$child" ] && kill "$child" 2>/dev/null; exit 0' TERM INT
pause() { sleep "$1" & child=$!; wait "$child"; child=""; }

echo "INFO vLLM API server version 0.0.0 (m31ctl test engine, mode $mode)"
echo "INFO Loading safetensors checkpoint shards: 100% Completed"
echo "INFO Loading weights took 0.10 seconds"
case $mode in
  oom)
    pause 1
    echo "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.81 GiB"
    exit 1 ;;
  crashloop)
    echo "RuntimeError: NCCL error: unhandled system error (run with NCCL_DEBUG=INFO for details)"
    exit 1 ;;
  hang)
    while true; do pause 1; done ;;
esac
echo "INFO torch.compile takes 0.5 s in total"
pause "$delay"
echo "INFO Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%"
mkdir -p /www/v1
echo ok > /www/health
printf '{"object":"list","data":[{"id":"%s","object":"model","owned_by":"vllm"}]}' "$served" > /www/v1/models
httpd -f -p 8000 -h /www &
child=$!
echo "INFO Application startup complete."
wait "$child"
