-- put.lua: writes what Postgres holds (after a completion commit, or to repair a marker that Redis lost).
-- Never replaces a completed record with an earlier state: a repair racing the owner's completion must
-- not leave a stale "in flight" behind.
--
-- KEYS[1]  the record, idem:{...}
-- ARGV[1]  state: 'p' in progress, 'c' completed, 'i' indeterminate
-- ARGV[2]  payload fingerprint (32 bytes)
-- ARGV[3]  owner token ('' unless in progress)
-- ARGV[4]  stored response ('' unless completed)
-- ARGV[5]  time to live in milliseconds
-- ARGV[6]  the channel settlements are published on
--
-- A record that a caller waits for (field w) is published once it settles (completed, indeterminate);
-- an in-progress one keeps its waiters.
--
-- Returns 1 if written, 0 if a completed record was kept (or a completed one could not be written).
-- A completed record is written as one string, fingerprint then response (see begin.lua); without a
-- 32-byte fingerprint it could not be read back, so no copy is written: a marker goes (its waiters are
-- told), and Postgres answers the key.
if ARGV[1] == 'c' and #ARGV[2] ~= 32 then
  if redis.call('TYPE', KEYS[1]).ok == 'hash' then
    local waiter = redis.call('HGET', KEYS[1], 'w')
    redis.call('DEL', KEYS[1])
    if waiter then
      redis.call('PUBLISH', ARGV[6], waiter)
    end
  end
  return 0
end
local kind = redis.call('TYPE', KEYS[1]).ok
-- A completed record, unless its string is too short to be one (a miss for begin.lua too).
if ARGV[1] ~= 'c' and kind == 'string' and redis.call('STRLEN', KEYS[1]) >= 32 then
  return 0
end
-- Only a marker has waiters (false when none).
local waiter = kind == 'hash' and redis.call('HGET', KEYS[1], 'w')
-- The first write is the one Redis's OOM check sees (under `noeviction` a full Redis refuses it): SET
-- replaces a key of any type by itself; a marker's HSET needs the old key gone first.
if ARGV[1] == 'c' then
  redis.call('SET', KEYS[1], ARGV[2] .. ARGV[4], 'PX', ARGV[5])
else
  if kind ~= 'none' then
    redis.call('DEL', KEYS[1])
  end
  redis.call('HSET', KEYS[1], 's', ARGV[1], 'h', ARGV[2], 't', ARGV[3])
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
end
if waiter then
  if ARGV[1] == 'p' then
    redis.call('HSET', KEYS[1], 'w', waiter)
  else
    redis.call('PUBLISH', ARGV[6], waiter)
  end
end
return 1
