-- LoadTracker.sweep (and its snapshot's first step), after load_functions.lua and
-- sweep_functions.lua. ARGV: ns -> entries released
return load_sweep(ARGV[1])
