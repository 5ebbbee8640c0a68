-- Ten accounts of 1,000 each, and twenty empty ones (ten pairs).
INSERT INTO account SELECT 'acct-' || n, 1000 FROM generate_series(0, 9) n;
INSERT INTO account SELECT 'empty-' || n, 0 FROM generate_series(0, 19) n;
