-- extend.lua: the Redis half of a lease heartbeat; keeps the owner's marker alive as long as its
-- Postgres lease, so duplicates keep hearing "in flight" from Redis.
--
-- KEYS[1]  the record, idem:{...} (only a hash, a marker, is ever extended)
-- ARGV[1]  owner token of the caller
-- ARGV[2]  new lease in milliseconds
--
-- Returns 1 if extended, 0 if the marker belongs to someone else or is gone.
if redis.call('TYPE', KEYS[1]).ok ~= 'hash' then
  return 0
end
local rec = redis.call('HMGET', KEYS[1], 's', 't')
if rec[1] == 'p' and rec[2] == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
