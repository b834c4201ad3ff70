"""The planner: profiles of servers, an advisor (``pdserve plan``), an SLA planner that scales the
prefill and decode pools (``pdserve planner``) and a simulator that replays traces against
servers modelled by the profiles. The core (profile models, predictors, corrections, the scaling
rule) is pure logic; sockets live only in the scraper, the connectors and the process."""
