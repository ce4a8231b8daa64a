# warm-up A/B after the budget fix: main's capture (torch.cuda.graph) vs the branch's capture_graph; minicpmo45 shared config
# .whl/old_arena.py and .whl/old_decode_graphs.py were main's duplexcache/cfm/arena.py and duplexcache/kv/decode_graphs.py (at 253ba01);
# the tree it ran in was the branch (main + capture_graph). Run from the repository root on the GPU machine, OUT set.
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/ab.txt
rm -rf /tmp/old && mkdir /tmp/old && cp -r . /tmp/old/ && cp .whl/old_arena.py /tmp/old/duplexcache/cfm/arena.py && cp .whl/old_decode_graphs.py /tmp/old/duplexcache/kv/decode_graphs.py
export TRITON_CACHE_DIR=/tmp/tc_ab; rm -rf $TRITON_CACHE_DIR
start() {  # ARM DIR
  local t0=$(date +%s.%N)
  ( cd $2 && PYTHONPATH=/tmp/site:$2 python3 -m duplexcache.cli serve --config examples/minicpmo45-shared.yaml --port 8000 > /tmp/serve_$1.log 2>&1 ) &
  for i in $(seq 160); do
    curl -s -o /dev/null -w "%{http_code}" http://127.0.0.1:8000/health 2>/dev/null | grep -q 200 && break; sleep 0.5
  done
  local ready=$(python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 1))" $t0 $(date +%s.%N))
  echo "$1 ready ${ready}s | $(grep -o 'engine warm-up took [0-9.]* s: [0-9]* graphs' /tmp/serve_$1.log) | $(grep -o 'memory_budget = .*' /tmp/serve_$1.log | head -1) | $(grep -o 'sized for [0-9]* reference sessions' /tmp/serve_$1.log) | $(grep -o 'device memory allocated .*' /tmp/serve_$1.log | head -1)" | tee -a $OUT/ab.txt
  pkill -INT -f "duplexcache.cli serve"; sleep 4; pkill -KILL -f "duplexcache.cli serve"; sleep 1
  cat /tmp/serve_$1.log >> /tmp/all.log
}
start cold_new $PWD
start old1 /tmp/old
start new1 $PWD
start old2 /tmp/old
start new2 $PWD
start old3 /tmp/old
gzip -c /tmp/all.log > $OUT/serve_logs.gz
