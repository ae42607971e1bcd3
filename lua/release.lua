-- release.lua: fenced compare-and-delete of an in-progress marker, so a retry is not told "in flight"
-- for work that failed or never started. Only the owner that wrote the marker can delete it.
--
-- KEYS[1]  the record hash, idem:{...}
-- ARGV[1]  owner token of the caller
-- ARGV[2]  'released' once Postgres released the record under the caller's fence: an indeterminate
--          copy of it is stale then and goes too ('' otherwise: only the caller's own marker goes)
-- ARGV[3]  the channel settlements are published on: a caller waiting for the marker (field w) hears
--          of the release
--
-- Returns 1 if the copy was deleted, 0 if it belongs to someone else or is gone.
local rec = redis.call('HMGET', KEYS[1], 's', 't', 'w')
if (rec[1] == 'p' and rec[2] == ARGV[1]) or (rec[1] == 'i' and ARGV[2] == 'released') then
  redis.call('DEL', KEYS[1])
  if rec[3] then
    redis.call('PUBLISH', ARGV[3], rec[3])
  end
  return 1
end
return 0
