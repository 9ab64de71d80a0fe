-- The two partial indexes added in 0002 cost about a tenth of delivery throughput (every claim,
-- report and hold rewrites them) and bought nothing measurable: the live-batch look-ups already use
-- push_delivery_batches_due, and cleanup's deadline scan runs in bounded rounds over it.
DROP INDEX IF EXISTS push_delivery_batches_held;
DROP INDEX IF EXISTS push_delivery_batches_deadline;
