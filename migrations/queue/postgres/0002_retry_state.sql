-- Retry state for retries until the deadline (attempts now count provider answers only) and the
-- provider a batch goes to, so the work of a provider that fails for everyone can be held in one
-- statement instead of being claimed and handed back.
ALTER TABLE push_delivery_batches ADD COLUMN retries INTEGER NOT NULL DEFAULT 0;
ALTER TABLE push_delivery_batches ADD COLUMN provider TEXT NOT NULL DEFAULT '';
-- The earliest time a retry may go (backoff, Retry-After): a held batch released early never goes
-- before it.
ALTER TABLE push_delivery_batches ADD COLUMN not_before BIGINT NOT NULL DEFAULT 0;
CREATE INDEX push_delivery_batches_held ON push_delivery_batches (provider, available_at)
    WHERE state = 'pending';
-- Cleanup finds work past its deadline without walking every live batch.
CREATE INDEX push_delivery_batches_deadline ON push_delivery_batches (deadline)
    WHERE state IN ('open', 'pending', 'leased');
