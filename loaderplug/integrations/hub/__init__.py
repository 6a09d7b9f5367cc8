"""The Hugging Face Hub hook's parts; the mirror's layout, a call served from it, the
mirror filled and synced, which commit, a Hub out of reach, what is said."""
