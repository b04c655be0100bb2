"""edge-queue's configuration (docs/configuration.md): the settings, loaded once from TOML and the
environment (:mod:`.settings`), each section's own model (:mod:`.api`, :mod:`.http`), the rules
for one value (:mod:`.values`), for what the sources hold (:mod:`.sources`) and for settings that
are valid one by one but cannot run together (:mod:`.rules`)."""
