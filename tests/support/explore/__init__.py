"""The interleaving explorer: the outcome protocol on the real store, in every order
(``tests/explore``; docs/development.md says how to add an actor or an invariant)."""
