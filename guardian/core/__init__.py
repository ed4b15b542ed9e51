"""The pure core: vocabulary, observations, rules and the tick's decision. No I/O, no clock,
no sleeping; imports nothing from guardian.observe, guardian.act or the shell above them."""
