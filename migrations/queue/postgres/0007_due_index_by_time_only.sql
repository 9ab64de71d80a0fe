-- The due index serves only statements that ask for batches by time. Its condition was the live
-- states alone, the same as push_delivery_batches_live's, so any statement that names the live
-- states (every look-up of a phone's batches does, for that index) could also read it, whole,
-- filtering every live batch by phone. A plan made on a table of a few hundred rows, before its
-- first analyze, did exactly that for the round's windows read, and kept doing it as the table
-- grew: with the providers refusing connections (admission benchmark, round 32,
-- docs/benchmarks.md), held batches piled up, and the windows read of one round read every one of
-- them (2.8 ms a call, 63% of the server's execution; 7,000 entries read for 8 rows).
--
-- A statement can read this index only if its conditions imply available_at IS NOT NULL, which
-- a comparison on available_at does (a claim, a hold; MIN(available_at) asks it itself) and a
-- look-up by phone does not. The column is NOT NULL, so the index holds the same rows as before.
-- Built under another name first: writes to the table wait while it builds (as in 0005).
CREATE INDEX push_delivery_batches_due_by_time ON push_delivery_batches (available_at)
    WHERE state IN ('open', 'pending', 'leased') AND available_at IS NOT NULL;
DROP INDEX push_delivery_batches_due;
ALTER INDEX push_delivery_batches_due_by_time RENAME TO push_delivery_batches_due;
