-- KEYS: claim, waiters, wake. ARGV: token, wake seconds.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  wake(KEYS[2], KEYS[3])
end
return 0
