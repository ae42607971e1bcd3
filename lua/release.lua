-- release.lua: fenced compare-and-delete of an in-progress marker, so a retry is not told "in flight"
-- for work that failed or never started. Only the owner that wrote the marker can delete it.
--
-- KEYS[1]  the record, idem:{...} (only a hash, a marker, is ever taken back)
-- ARGV[1]  owner token of the caller
-- ARGV[2]  what taking the marker back means:
--          'released'    Postgres released the record under the caller's fence: an indeterminate copy of
--                        it is stale then and goes too, and a caller waiting for it (field w) hears of it
--          'rolled_back' the caller's claim was rolled back (it owned the key until then): waiters hear
--          ''            the caller's marker answered for a key Postgres gave to someone else, or to no
--                        one: only the marker goes, and no one is told (a waiter flagged on such a marker
--                        asks again within its re-check; telling it would have every waiter's marker
--                        wake the others in turn)
-- ARGV[3]  the channel settlements are published on
--
-- Returns 1 if the copy was deleted, 0 if it belongs to someone else or is gone.
if redis.call('TYPE', KEYS[1]).ok ~= 'hash' then
  return 0
end
local rec = redis.call('HMGET', KEYS[1], 's', 't', 'w')
if (rec[1] == 'p' and rec[2] == ARGV[1]) or (rec[1] == 'i' and ARGV[2] == 'released') then
  redis.call('DEL', KEYS[1])
  if rec[3] and ARGV[2] ~= '' then
    redis.call('PUBLISH', ARGV[3], rec[3])
  end
  return 1
end
return 0
