-- begin.lua: the hot-path claim. Answers duplicates from Redis, or writes an in-progress marker so that
-- concurrent duplicates are told "in flight" while the caller claims the key durably in Postgres.
-- A "claimed" answer never means "execute": Postgres decides that.
--
-- KEYS[1]  the record, idem:{...}
-- ARGV[1]  payload fingerprint (the 32 bytes of its SHA-256)
-- ARGV[2]  owner token of the caller
-- ARGV[3]  lease in milliseconds (the marker's PX)
-- ARGV[4]  the key's digest if the caller waits for an in-flight owner and follows the settled channel,
--          else ''
--
-- A completed record is one string: its fingerprint (32 bytes), then its response. A hash whose field
-- passes 64 bytes leaves Redis's compact encoding and costs about twice the memory, so only markers are
-- hashes: s = state ('p' in progress, 'i' indeterminate), h = fingerprint, t = owner token (in progress
-- only), w = the digest to publish when the in-progress record settles (only once a caller waits).
--
-- Returns one of:
--   {'claimed'}                  no record (or a malformed one): the marker is written, claim in
--                                Postgres next. Also the answer to the caller's own marker: a client
--                                that re-sends the script (a Redis Cluster client retries a call whose
--                                connection dropped after sending) must not be told its key is in flight.
--   {'mismatch'}                 the key's settled record (completed or indeterminate) holds a
--                                different fingerprint
--   {'unconfirmed'}              an in-progress marker holds a different fingerprint; it may be the marker
--                                of a request that Postgres is about to refuse, so ask Postgres instead
--                                (nothing is written)
--   {'in_flight', pttl_ms}       another owner holds the key (a waiting caller's digest is written first)
--   {'completed', response}      replay this response
--   {'indeterminate'}            the key awaits resolution
local kind = redis.call('TYPE', KEYS[1]).ok
local state, fingerprint, response, waiter, owner
if kind == 'string' then
  local packed = redis.call('GET', KEYS[1])
  if #packed >= 32 then
    state, fingerprint, response = 'c', string.sub(packed, 1, 32), string.sub(packed, 33)
  end
elseif kind == 'hash' then
  local rec = redis.call('HMGET', KEYS[1], 's', 'h', 'w', 't')
  state, fingerprint, waiter, owner = rec[1], rec[2], rec[3], rec[4]
end

-- No record, or one outside this contract (fields lost, a hash that says 'c', or written by something
-- else): a miss. It is replaced by the caller's marker, and Postgres decides.
local valid = fingerprint and (state == 'p' or state == 'i' or (state == 'c' and response))
if not valid then
  -- Only a malformed record is deleted: a write before HSET would let the script past Redis's OOM check
  -- (which refuses a script's first write), so under `noeviction` a full Redis could still grow.
  if kind ~= 'none' then
    redis.call('DEL', KEYS[1])
  end
  redis.call('HSET', KEYS[1], 's', 'p', 'h', ARGV[1], 't', ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {'claimed'}
end
if fingerprint ~= ARGV[1] then
  if state == 'p' then
    return {'unconfirmed'}
  end
  return {'mismatch'}
end
if state == 'c' then
  return {'completed', response}
end
if state == 'i' then
  return {'indeterminate'}
end
if owner == ARGV[2] then
  return {'claimed'}
end
if ARGV[4] ~= '' and waiter ~= ARGV[4] then
  redis.call('HSET', KEYS[1], 'w', ARGV[4])
end
return {'in_flight', redis.call('PTTL', KEYS[1])}
