"""pdserve.router.migration: moving a streamed request to another decode worker mid-stream: the transcript, the OpenAI flavour of it, and the relay that resumes."""
