-- The due index is keyed by provider first, then time. Keyed by time alone, every read that leaves
-- a provider alone (a lane whose sender's breaker holds that provider) walked the held provider's
-- due batches in time order to reach the first batch of another: with the providers refusing
-- connections (admission benchmark, round 47, docs/benchmarks.md) about 15,000 entries per read,
-- once per lane at each probe of the breaker, 80-115 ms in which admissions waited. A claim for
-- the provider still answering walked them the same way, in the writer's round. The claims and
-- the next-due read now ask each provider they take apart (services/queue/src/store/claims.rs),
-- each a seek into its provider's range; a provider's hold reads only that provider's range.
-- The index holds the same rows, so a write costs what it did. A build that predates this
-- migration still finds what is due, reading the index whole.
DROP INDEX IF EXISTS push_delivery_batches_due;
CREATE INDEX push_delivery_batches_due ON push_delivery_batches (provider, available_at)
    WHERE state IN ('open', 'pending', 'leased');
