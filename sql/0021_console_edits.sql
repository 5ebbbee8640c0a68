-- Edit and retry from the console (`console --allow-edits`): a letter
-- replayed with a body an operator edited. The audit keeps both bodies,
-- the one that died and the one sent in its place, as they were.
ALTER TABLE idem_console_audit
    ADD COLUMN body_before BYTEA,
    ADD COLUMN body_after  BYTEA;
