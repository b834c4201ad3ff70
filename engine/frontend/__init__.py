"""The HTTP front end and the offline Engine: requests in, text and logprobs out."""
