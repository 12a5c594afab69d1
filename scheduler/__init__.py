"""The central scheduler service: membership, link collection, re-planning, policy consistency."""
