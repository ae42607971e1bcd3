-- wrk script of the HTTP benchmark (benches/http/main.rs sets the environment).
--   HTTP_BENCH_PATH      the route to POST to
--   HTTP_BENCH_KEYS      "unique": a fresh Idempotency-Key per request; N: cycle through N keys;
--                        "none": no key header
--   HTTP_BENCH_PREFIX    the keys' prefix (one per cell, so cells never share keys)
--   HTTP_BENCH_EXPECT    the status every answer should have; others are counted as unexpected
--   HTTP_BENCH_COOKIE    optional: a Cookie header to send (a session, for peers/)
-- Prints one JSON line at the end: requests, unexpected answers, socket errors, latency percentiles (us).

local path = os.getenv("HTTP_BENCH_PATH")
local keys = os.getenv("HTTP_BENCH_KEYS")
local prefix = os.getenv("HTTP_BENCH_PREFIX")
local expect = tonumber(os.getenv("HTTP_BENCH_EXPECT"))
local cookie = os.getenv("HTTP_BENCH_COOKIE")
local body = '{"amount":1250,"currency":"eur","customer":"cus_bench","description":"benchmark charge"}'

local threads = {}
local next_thread = 0

function setup(thread)
  thread:set("tid", next_thread)
  next_thread = next_thread + 1
  table.insert(threads, thread)
end

function init(args)
  sent = 0
  unexpected = 0
end

function request()
  sent = sent + 1
  local headers = { ["Content-Type"] = "application/json", ["Authorization"] = "Bearer bench" }
  if cookie then
    headers["Cookie"] = cookie
  end
  if keys == "unique" then
    headers["Idempotency-Key"] = prefix .. "-" .. tid .. "-" .. sent
  elseif keys ~= "none" then
    headers["Idempotency-Key"] = prefix .. "-" .. (sent % tonumber(keys))
  end
  return wrk.format("POST", path, headers, body)
end

function response(status, headers, body)
  if status ~= expect then
    unexpected = unexpected + 1
  end
end

function done(summary, latency, requests)
  local wrong = 0
  for _, thread in ipairs(threads) do
    wrong = wrong + thread:get("unexpected")
  end
  local e = summary.errors
  io.write(string.format(
    '{"requests":%d,"duration_us":%d,"unexpected":%d,"socket_errors":%d,"p50_us":%d,"p99_us":%d,"p999_us":%d}\n',
    summary.requests, summary.duration, wrong, e.connect + e.read + e.write + e.timeout,
    latency:percentile(50), latency:percentile(99), latency:percentile(99.9)))
end
