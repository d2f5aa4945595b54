-- ARGV: prefix, and an origin (else all of them). Returns record rows.
local origins = ARGV[2] and {ARGV[2]} or redis.call('SMEMBERS', KEYS[1])
local now, out = clock(), {}
for _, origin in ipairs(origins) do records(origin, now, out) end
return out
