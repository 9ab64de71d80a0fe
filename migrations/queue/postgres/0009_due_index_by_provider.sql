-- The due index is keyed by provider first, then time (as on SQLite, queue migration 0007 there).
-- Keyed by time alone, every read that leaves a provider alone (a lane whose sender's breaker
-- holds that provider) walked the held provider's due batches in time order to reach the first
-- batch of another, and a claim for the provider still answering walked them the same way. The
-- claims and the next-due read now ask each provider they take apart
-- (services/queue/src/store/claims.rs), each a seek into its provider's range. The condition
-- stays 0007's: only statements that ask by time name available_at >= 0. The index holds the
-- same rows. Built under another name first: writes to the table wait while it builds (as in
-- 0005 and 0007). A build that predates this migration still finds what is due, reading the
-- index whole.
CREATE INDEX push_delivery_batches_due_by_provider ON push_delivery_batches (provider, available_at)
    WHERE state IN ('open', 'pending', 'leased') AND available_at >= 0;
DROP INDEX push_delivery_batches_due;
ALTER INDEX push_delivery_batches_due_by_provider RENAME TO push_delivery_batches_due;
