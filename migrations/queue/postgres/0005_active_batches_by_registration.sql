-- The batches of a registration, for the statements that look them up by registration (joining or
-- reading a window, taking a group's locks, a dismissal's cancelling and recounting), which all
-- ask only for live batches (open, pending or leased). The index it replaces held every batch
-- kept for the 24 hours of retention, keyed by its state too: every admission wrote its new
-- batch's entry into a random leaf page of a large index, and every claim and report moved the
-- entry again. Counted in the queue's WAL at 1,000 delivery flows on SQLite: 31% of the pages a
-- commit wrote (9% with this one). Holding only live batches, the index stays a few pages per
-- thousand phones with work, so a round's entries share them; a batch's entry is written when it
-- is created and removed when it ends. The state stays in the key so that a window is found
-- without reading the phone's other live batches (held ones pile up while a provider is down).
DROP INDEX IF EXISTS push_delivery_batches_window;
CREATE INDEX push_delivery_batches_live ON push_delivery_batches (registration_id, state)
    WHERE state IN ('open', 'pending', 'leased');
