-- The due index serves only statements that ask for batches by time. Its condition was the live
-- states alone, the same as push_delivery_batches_live's, so any statement that names the live
-- states (every look-up of a phone's batches does, for that index) could also read it, whole,
-- filtering every live batch by phone. A plan made on a table of a few hundred rows, before its
-- first analyze, did exactly that for the round's windows read, and kept doing it as the table
-- grew: with the providers refusing connections (admission benchmark, round 32,
-- docs/benchmarks.md), held batches piled up, and the windows read of one round read every one of
-- them (2.8 ms a call, 63% of the server's execution; 6,000-7,600 entries read for 8 rows).
--
-- A statement can read this index only if its conditions imply available_at >= 0, always true of
-- a time: the statements that ask by time name it (a claim, the next-due read, a provider's
-- hold), and a look-up by phone does not. Not IS NOT NULL, which a comparison would imply by
-- itself: PostgreSQL 17 drops IS NOT NULL conditions on NOT NULL columns from queries (and a
-- later release from index conditions too), which would undo this. The index holds the same
-- rows. Built under another name first: writes to the table wait while it builds (as in 0005).
CREATE INDEX push_delivery_batches_due_by_time ON push_delivery_batches (available_at)
    WHERE state IN ('open', 'pending', 'leased') AND available_at >= 0;
DROP INDEX push_delivery_batches_due;
ALTER INDEX push_delivery_batches_due_by_time RENAME TO push_delivery_batches_due;
