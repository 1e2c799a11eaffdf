"""Source analysis: find the sites and judge them."""
