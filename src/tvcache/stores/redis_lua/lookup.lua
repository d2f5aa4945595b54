-- KEYS: entries, hits, claim. ARGV: field, claim milliseconds (0: do not claim), token.
-- Returns the entry (bytes), 1 (claimed), 0 (someone else holds the claim) or nil (a miss, not claiming).
local entry = redis.call('HGET', KEYS[1], ARGV[1])
if entry then
  redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
  return entry
end
if ARGV[2] == '0' then return false end
if redis.call('SET', KEYS[3], ARGV[3], 'NX', 'PX', ARGV[2]) then return 1 end
return 0
